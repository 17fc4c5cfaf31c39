"""Training throughput of astrai's Trainer against a plain PyTorch loop over transformers' Llama.

Both sides train a model of the same shape (preset → LlamaConfig with the same sizes),
on the same random batches, with the same threads, optimizer (AdamW), gradient
clipping and precision (fp32, or bf16 autocast with fp32 master weights). astrai's
side is the full Trainer: strategy, exact-accumulation weighting, callbacks (clipping,
JSONL metric logging, checkpoint bookkeeping), scheduler. Each side runs its steps in
alternating rounds; since contention from other processes only adds time, the ratio
uses each side's fastest step and reports the median ratio beside it. The achieved
FLOP/s (6·N·tokens + attention) is compared with this machine's measured matmul peak and, on a
GPU (``--device cuda``), with its dense bf16 peak from the data sheet: the model FLOPs
utilisation (MFU) that torchtitan and nanochat report. ``--compile`` compiles astrai's model (``+c`` in the output; ``--compile bf16`` only for the
bf16 rows), which pays on a CPU at both precisions (docs/training.md).

    OMP_NUM_THREADS=2 .venv/bin/python bench/train.py --presets tiny small --steps 3 --rounds 3 --compile
    python bench/train.py --device cuda --presets small 1b --precisions bf16 --batch 8 --seq 2048 --compile
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch.utils.data import Dataset

from results_file import write_result  # bench/ is on sys.path when a script runs


class RandomTokens(Dataset):
    def __init__(self, n: int, window: int, vocab: int):
        self.tokens = torch.randint(0, vocab, (n, window + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "target_ids": self.tokens[i, 1:]}


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, FLOP/s: the MFU denominator.
GPU_BF16_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "RTX 4090": 165e12}


def gpu_bf16_peak(device: torch.device):
    """The data-sheet dense bf16 peak of ``device``'s GPU, or None for a GPU not listed."""
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_BF16_PEAKS.items() if key in name), None)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock reads what it ran (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, device: torch.device = torch.device("cpu"), size: int = 1024,
                repeats: int = 20) -> float:
    """This machine's best FLOP/s for a size² matmul: PyTorch's own (MKL for fp32, oneDNN for
    bf16, cuBLAS on a GPU) or, for fp32 on a CPU, oneDNN's, which astrai trains with where it is
    faster (on some CPUs about twice MKL's), so the fraction of peak stays below one."""
    a, b = torch.randn(size, size, dtype=dtype, device=device), torch.randn(size, size, dtype=dtype, device=device)
    kernels = [lambda: a @ b]
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from astrai.backends.cpu.training import onednn_matmul

        kernels.append(lambda: onednn_matmul(a, b))
    best = float("inf")
    for kernel in kernels:
        kernel()
        best = min(best, min(_timed(kernel, device) for _ in range(repeats)))
    return 2 * size ** 3 / best


def _timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def flops_per_token(config, window: int) -> float:
    n = config.dim * config.vocab_size  # lm head (tied with the embedding, counted once)
    head_dim = config.resolved_head_dim
    attn = config.dim * head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
    n += config.n_layers * (attn + 3 * config.dim * config.dim_ffn)
    return 6 * n + 12 * config.n_layers * config.n_heads * head_dim * window


class AstraiSide:
    def __init__(self, config, args, precision: str, tmp: str):
        from astrai.config import TrainConfig
        from astrai.model import AutoModel
        from astrai.trainer import TrainCallback, Trainer

        steps = args.warmup + args.steps * args.rounds
        train_config = TrainConfig(train_type="seq", batch_per_device=args.batch, window_size=args.seq, max_steps=steps,
                                   precision=precision, ckpt_dir=tmp, ckpt_interval=10 ** 9, progress_bar=False,
                                   save_final_model=False, compile=precision in args.compile, warmup_ratio=0.0,
                                   device=str(args.device), gradient_checkpointing=args.checkpointing)
        torch.manual_seed(0)
        model = AutoModel.from_config(config)
        self.trainer = Trainer(train_config, model=model,
                               train_dataset=RandomTokens(args.batch * (steps + 1), args.seq, config.vocab_size))
        self.context = self.trainer._build_context(None)
        self.callback_base, self.device = TrainCallback, args.device

    def run(self, steps: int) -> list[float]:
        """Run ``steps`` more optimizer steps through the Trainer's own loop; return their durations."""
        times: list[float] = []
        device = self.device

        class Timer(self.callback_base):
            def on_step_begin(self, context):
                synchronize(device)
                self.start = time.perf_counter()

            def on_step_end(self, context):
                synchronize(device)
                times.append(time.perf_counter() - self.start)

        context, before = self.context, self.context.step
        context.total_steps = before + steps
        self.trainer.callbacks = [Timer()]
        self.trainer._run(context)
        if context.step - before != steps or len(times) != steps:
            raise RuntimeError(f"astrai's trainer ran {context.step - before} of {steps} steps ({len(times)} timed): "
                               f"epoch {context.epoch}, batch {context.batch_in_epoch} of {context.steps_per_epoch}, "
                               f"stop requested {context.stop_requested}, error {context.error!r}")
        return times


class ReferenceSide:
    def __init__(self, config, args, precision: str):
        import transformers

        llama = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.dim,
                                         intermediate_size=config.dim_ffn, num_hidden_layers=config.n_layers,
                                         num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                                         max_position_embeddings=config.max_len, rope_theta=config.rope_theta,
                                         rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_weight)
        torch.manual_seed(0)
        self.device = args.device
        self.model = transformers.LlamaForCausalLM(llama).to(self.device).train()
        self.model.config._attn_implementation = "sdpa"
        if args.checkpointing:
            self.model.gradient_checkpointing_enable()
        # fused on a GPU, as astrai's own AdamW is there
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                           fused=self.device.type == "cuda" or None)
        self.data = RandomTokens(args.batch * 4, args.seq, config.vocab_size)
        self.batch, self.bf16 = args.batch, precision == "bf16"

    def run(self, steps: int) -> list[float]:
        times = []
        for i in range(steps):
            batch = [self.data[(i * self.batch + j) % len(self.data)] for j in range(self.batch)]
            ids = torch.stack([b["input_ids"] for b in batch]).to(self.device)
            labels = torch.stack([b["target_ids"] for b in batch]).to(self.device)
            synchronize(self.device)
            start = time.perf_counter()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            synchronize(self.device)
            times.append(time.perf_counter() - start)
        return times


def bench_one(preset_name: str, precision: str, args, peaks: dict) -> dict:
    from astrai.config import preset

    config = preset(preset_name)
    with tempfile.TemporaryDirectory() as tmp:
        ours, ref = AstraiSide(config, args, precision, tmp), ReferenceSide(config, args, precision)
        ours.run(args.warmup)
        ref.run(args.warmup)
        times = {"astrai": [], "transformers": []}
        for _ in range(args.rounds):
            times["astrai"] += ours.run(args.steps)
            times["transformers"] += ref.run(args.steps)
    tokens = args.batch * args.seq
    rate = {k: tokens / min(v) for k, v in times.items()}
    median = {k: tokens / statistics.median(v) for k, v in times.items()}
    flops = flops_per_token(config, args.seq)
    peak = peaks[precision]
    sheet = peaks.get("data_sheet_bf16")
    result = {"preset": preset_name, "precision": precision, "compiled": precision in args.compile,
              "parameters": sum(p.numel() for p in ours.context.model.parameters()),
              "astrai_tokens_per_s": rate["astrai"], "transformers_tokens_per_s": rate["transformers"],
              "ratio": rate["astrai"] / rate["transformers"], "median_ratio": median["astrai"] / median["transformers"],
              "astrai_fraction_of_matmul_peak": rate["astrai"] * flops / peak,
              "transformers_fraction_of_matmul_peak": rate["transformers"] * flops / peak, "step_seconds": times}
    if sheet:
        result.update(astrai_mfu=rate["astrai"] * flops / sheet, transformers_mfu=rate["transformers"] * flops / sheet,
                      astrai_median_mfu=median["astrai"] * flops / sheet)
    print(f"{preset_name:6s} {precision + ('+c' if result['compiled'] else ''):7s} astrai {rate['astrai']:9.1f} tok/s  transformers {rate['transformers']:9.1f} tok/s"
          f"  ratio {result['ratio']:.2f} (median {result['median_ratio']:.2f})"
          f"  peak fraction {result['astrai_fraction_of_matmul_peak']:.1%} vs {result['transformers_fraction_of_matmul_peak']:.1%}"
          + (f"  MFU {result['astrai_mfu']:.1%} vs {result['transformers_mfu']:.1%}" if sheet else ""), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile", nargs="*", choices=["fp32", "bf16"], default=None, metavar="PRECISION",
                        help="torch.compile astrai's model at these precisions (all when none is named); "
                             "see docs/training.md")
    parser.add_argument("--device", default="cpu", type=torch.device, help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on both sides")
    parser.add_argument("--out", default=None, help="JSON path (default: a dated file in bench/results/)")
    args = parser.parse_args()
    args.compile = [] if args.compile is None else args.compile or args.precisions
    torch.set_num_threads(args.threads)
    if args.device.type == "cpu":
        from astrai.backends.cpu import tune_process

        tune_process()  # as the CLI verbs do; it applies to both sides of every comparison
    size = 8192 if args.device.type == "cuda" else 1024
    peaks = {"fp32": matmul_peak(torch.float32, args.device, size), "bf16": matmul_peak(torch.bfloat16, args.device, size)}
    if args.device.type == "cuda":
        peaks["data_sheet_bf16"] = gpu_bf16_peak(args.device)
    print(f"matmul peak: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s"
          + (f", data sheet bf16 {peaks['data_sheet_bf16'] / 1e12:.0f} TFLOP/s" if peaks.get("data_sheet_bf16") else ""),
          flush=True)
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
           "device": str(args.device), "checkpointing": args.checkpointing,
           "batch": args.batch, "seq": args.seq, "matmul_peak_flops": peaks, "results": []}
    path = args.out
    for p in args.presets:
        for prec in args.precisions:
            out["results"].append(bench_one(p, prec, args, peaks))
            path = write_result("train", out, path)  # after each row: a run stopped partway keeps its rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
