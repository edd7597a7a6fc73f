"""The prompts a draft's acceptance is measured on when marspec chooses a draft length.

Written for this purpose, in the kinds of work the demo shows (code, arithmetic explained in words,
prose), and taken from no evaluation set: the draft length must not be tuned on what it is judged on.
"""

CALIBRATION_PROMPTS: tuple[str, ...] = (
    "Write a Python function `word_counts(text)` that returns a dictionary mapping each lower-cased word "
    "of the text to how many times it appears, ignoring punctuation. Add a short docstring.",
    "A garden bed is 3 metres long and 2 metres wide. Seeds are planted every 25 centimetres in rows "
    "25 centimetres apart. About how many seeds fit in the bed? Explain each step.",
    "Describe in one paragraph how a bicycle's gears make it easier to ride up a hill.",
)
