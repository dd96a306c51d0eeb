"""Repeat the two-process TRL example N times and report hangs (a tool, not a pytest test).

    flock /work/locks/exp.lock python tests/integrations/repeat_ddp.py --runs 20 --out runs/ddp-repeat

Each run is ``accelerate launch --multi_gpu --num_processes 2 examples/trl/train_grpo.py``
(CPU: gloo) with a wall-clock limit. A run that passes the limit is a hang: the stacks of
every process of the run are dumped with ``py-spy dump`` (when ``--py-spy`` points to it),
then the run is killed. One JSON line per run goes to ``<out>/runs.jsonl`` as it finishes
(wall time, return code, hang, which step printed last), and the stdout / stderr of each
run to ``<out>/run<i>.log``; a summary line closes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    return seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a run counts as hung")
    ap.add_argument("--out", default="runs/ddp-repeat")
    ap.add_argument("--max-steps", type=int, default=2)
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy binary for stack dumps of a hung run")
    ap.add_argument("--launcher", choices=["accelerate", "torchrun"], default="accelerate")
    ap.add_argument("--script", default=str(ROOT / "examples" / "trl" / "train_grpo.py"))
    a = ap.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    script = a.script
    if a.launcher == "accelerate":
        cmd = [str(bindir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
    else:
        cmd = [str(bindir / "torchrun"), "--nproc_per_node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")
    hangs, fails, times = 0, 0, []
    t_all = time.time()
    for i in range(a.runs):
        port = 29500 + (os.getpid() + i) % 2000
        extra = ["--main_process_port", str(port)] if a.launcher == "accelerate" else ["--master_port", str(port)]
        full = cmd + extra + [script, "--max-steps", str(a.max_steps), "--output-dir",
                              str(out / f"out{i}")]
        log = out / f"run{i}.log"
        t0 = time.time()
        with open(log, "w") as fh:
            p = subprocess.Popen(full, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=a.timeout)
                hung = False
            except subprocess.TimeoutExpired:
                hung = True
                pids = _descendants(p.pid)
                with open(out / f"run{i}.stacks", "w") as sf:
                    for pid in pids:
                        sf.write(f"==== pid {pid}: {open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' ')}\n")
                        if a.py_spy:
                            r = subprocess.run([a.py_spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                                               text=True, timeout=60)
                            sf.write(r.stdout + r.stderr + "\n")
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
        dt = time.time() - t0
        text = log.read_text(errors="replace")
        steps = [ln for ln in text.splitlines() if ln.startswith("step ")]
        rec = {"run": i, "wall_s": round(dt, 2), "rc": rc, "hung": hung, "summary_printed": bool(steps),
               "last_line": text.strip().splitlines()[-1][-200:] if text.strip() else ""}
        hangs += hung
        fails += (not hung) and rc != 0
        if not hung:
            times.append(dt)
        with open(out / "runs.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    summary = {"runs": a.runs, "hangs": hangs, "failures": fails, "launcher": a.launcher,
               "wall_s_min": round(min(times), 2) if times else None,
               "wall_s_max": round(max(times), 2) if times else None,
               "wall_s_mean": round(sum(times) / len(times), 2) if times else None,
               "total_s": round(time.time() - t_all, 1)}
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 1 if hangs or fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
