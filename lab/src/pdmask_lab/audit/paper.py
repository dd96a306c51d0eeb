"""The paper's reported audit figures, printed next to ours in the report and the plots."""

#: The paper's reported figures (METHOD.md section 5); definitions there were not available.
PAPER = {
    "seeds": 61,
    "sequences_per_rollout": 1024,
    "unsafe_keep": {"predictive": 0.342, "ratio": 0.369},
    "corrective": {"predictive": 0.651, "ratio": 0.629},
    "out_of_region_per_seed": 1435,
    "disagreement_per_seed": 82,
    "top20_kl_share": "> 0.99",
    "paper_estimators": "aggregated and uniform nearly identical",
}
