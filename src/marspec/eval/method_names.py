"""The method names a benchmark accepts, spelled out once for ``marspec bench --help`` and for the errors
of :func:`marspec.eval.methods.parse_methods` (kept apart from that module, which needs torch, so the
command line's help loads none)."""

METHOD_HELP = (
    "plain, strict, block, mars, mars@THETA, mars@auto, mars-ratio@THETA, mars-prob@THETA, mars-gap@THETA "
    "(marspec's also +tree; MARS's also +next, the next-token guard; MARS's and the rivals' also +class, "
    "the token-class guard), the rival rules typical@EPS, pthresh@P, topk@K, fly@ENTROPY and "
    "fly-wN@ENTROPY (FLy, window N), ensemble@WEIGHT, hf-assisted, hf-prompt-lookup"
)
