"""The docs, the committed records under docs/results and the README hold no machine path.

A record is read on other machines and compared across CPUs: an absolute path of the
machine that wrote it (its venv's interpreter, its model cache, a worktree's run directory,
a lock file of a shared machine) says nothing there. The writers record paths relative to
the run directory, pdmask's cache entries as ``$PDMASK_CACHE/...`` and interpreters by name
(pdmask.train.portable, pdmask.train.environment); this keeps the committed files so.
"""

import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
#: an absolute path under a directory that is some machine's own: home directories, scratch,
#: temporary and mounted storage, a checkout or a venv outside the repository
MACHINE_PATH = re.compile(
    r"(?<![\w.:/~$-])/(?:root|home|Users|work|tmp|mnt|scratch|opt|private|srv|nfs|data|var/folders)/[^\s\"'`)]+"
    r"|\b[A-Za-z]:\\(?:Users|Documents and Settings)\\[^\s\"'`)]+")
TEXT = (".md", ".json", ".jsonl", ".yaml", ".yml", ".txt", ".csv", ".tsv")


def _files() -> list[Path]:
    docs = [p for p in (REPO / "docs").rglob("*") if p.is_file() and p.suffix in TEXT]
    return sorted(docs) + [p for p in (REPO / "README.md", REPO / "mkdocs.yml", REPO / "lab" / "README.md") if p.exists()]


def test_the_pattern_finds_machine_paths_and_nothing_else():
    bad = ['"executable": "/work/venv/bin/python3"', "checkpoint `/root/.cache/pdmask/models/x-c1`",
           "--config /work/main/configs/real-audit.yaml", "flock /work/locks/exp.lock env", "--out /tmp/ddp-repeat",
           r"C:\Users\alice\pdmask", "/home/bob/.cache/huggingface/hub"]
    good = ["$PDMASK_CACHE/models/smollm2-135m-b179c9523d0e6a0f-c1", "~/.cache/pdmask", "runs/ladder/fp8-sync8",
            "https://download.pytorch.org/whl/cpu", "/proc/cpuinfo", "docs/results/real-rl/ladder.md", "python3 (venv)",
            "OUT/<rung>/<run>/checkpoints/"]
    assert all(MACHINE_PATH.search(s) for s in bad), [s for s in bad if not MACHINE_PATH.search(s)]
    assert not any(MACHINE_PATH.search(s) for s in good), [s for s in good if MACHINE_PATH.search(s)]


def test_no_machine_path_in_docs_records_or_readme():
    files = _files()
    assert len(files) > 100 and REPO / "README.md" in files  # the records are there to be read
    hits = {}
    for f in files:
        found = sorted({m.group(0) for m in MACHINE_PATH.finditer(f.read_text(errors="replace"))})
        if found:
            hits[str(f.relative_to(REPO))] = found[:3]
    assert not hits, f"machine paths in {len(hits)} files: {dict(list(hits.items())[:10])}"
