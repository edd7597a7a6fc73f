"""The method names a benchmark accepts, spelled out once for ``marspec bench --help`` and for the errors
of :func:`marspec.eval.methods.parse_methods` (kept apart from that module, which needs torch, so the
command line's help loads none)."""

METHOD_HELP = (
    "plain, strict, block, mars, mars@THETA, mars@auto, mars-ratio@THETA, mars-prob@THETA, mars-gap@THETA "
    "(marspec's also +tree; MARS's also +next, the next-token guard; MARS's and the rivals' also +class, "
    "the token-class guard), the rival rules typical@EPS, pthresh@P, topk@K, fly@ENTROPY and "
    "fly-wN@ENTROPY (FLy, window N), ensemble@WEIGHT, hf-assisted, hf-prompt-lookup"
)

# The methods a run is measured against, by the names its records and summaries carry: ``plain`` decodes
# without a drafter, ``strict`` is the lossless reference of speed and quality; ``mars`` alone is the run's
# own MARS setting (--theta, --margin).
PLAIN = "plain"
REFERENCE = "strict"
RUN_MARS = "mars"
