"""Loading and using a tokenizer directory leaves torch unimported: `astrai tokenizer encode`
answers in about 0.1 s instead of the 3 s torch takes to load (the GGUF reader, which does
import torch, is reached only for a GGUF file)."""

from __future__ import annotations

import json
import subprocess
import sys

from astrai.tokenize import AutoTokenizer


def test_tokenizer_directory_does_not_import_torch(tmp_path):
    AutoTokenizer.train(["hello world, the cat sat on the mat"] * 20, vocab_size=280).save_pretrained(tmp_path)
    code = ("import json, sys\n"
            "from astrai.cli import main\n"
            f"main(['tokenizer', 'encode', {str(tmp_path)!r}, 'hello world'])\n"
            "print(json.dumps('torch' in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "".join(json.loads(lines[0])["pieces"]) == "hello world"
    assert json.loads(lines[-1]) is False
