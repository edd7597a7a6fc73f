"""Drafting defaults, chosen by measurement on the default pair (docs/results.md, "Drafter settings").

Kept in a module without heavy imports so the CLI can show them in --help without loading torch.
"""

# Most draft tokens per step; confidence-stopped drafts are usually shorter. With prepacked kernels a
# 13-token verification costs about one step: k = 12 measured 3.52x against 3.13x for k = 8.
DEFAULT_K = 12
DEFAULT_DRAFT_QUANT = "int8"
DEFAULT_DRAFT_CONFIDENCE = 0.4
DEFAULT_LOOKUP = False  # measured: 3-gram lookups drafted worse than the model (tau 7.2-8.0 vs 8.7-9.0)
DEFAULT_PREPACK = True  # measured: a 21-token target forward 1289 -> 424 ms, a 1-token one 395 -> 317 ms

# MARS's close-call threshold and margin: the paper's setting. docs/results.md ("MARS quality") measures
# what it costs on the default pair; `marspec calibrate` and theta="auto" choose per pair by measurement.
DEFAULT_THETA = 0.9
DEFAULT_MARGIN = "logit_ratio"
