"""The flags of every ``astrai`` verb, in modules that import nothing heavy.

``astrai VERB --help`` and a mistyped flag are answered from these modules alone, before
torch, tokenizers or FastAPI load (seconds on a small machine). The code a verb runs lives
beside what it drives (``astrai/inference/cli.py``, ``astrai/eval/cli.py``, ...), or here
(``train_run.py``) where it chooses between two packages (the generic loop and alignment);
``astrai/cli.py`` names both halves of each verb. Choices that the heavy modules define
(dtypes, quantization formats) are spelled out here and kept equal to theirs by
tests/test_cli_startup.py.
"""
