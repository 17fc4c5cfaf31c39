"""The quick start, ``astrai quickstart``: a model's whole life on the bundled data in one command.

from_scratch.py trains a tokenizer and a tiny model (pre-training, SFT, DPO, GRPO) with an
evaluation after every stage and a report; from_pretrained.py (``--base``) starts from a
pretrained model and runs the fine-tuning stages on it; cli.py is the verb's run (its flags:
astrai/commands/quickstart.py).
"""

from astrai.quickstart.from_scratch import Settings, run_quickstart

__all__ = ["Settings", "run_quickstart"]
