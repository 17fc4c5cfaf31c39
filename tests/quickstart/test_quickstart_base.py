"""``astrai quickstart --base``: the run from a pretrained model, end to end at a miniature
budget on a tiny Hugging Face directory and a tiny GGUF file made here, plus its checker
and its refusals of a bad ``--base``.

The stage plan is pinned (a few steps each) so nothing depends on how busy the machine is.
"""

import json
import re

import gguf
import numpy as np
import pytest
from figures import same_figures
import torch
import transformers
from safetensors.torch import load_file

from astrai.cli import main as astrai_main
from astrai.dataset import arithmetic
from astrai.dataset.arithmetic import check_answer, task_pools, worked_solution
from astrai.errors import ConfigError
from astrai.eval.recorded import load_eval_config
from astrai.inference import InferenceEngine
from astrai.quickstart import from_pretrained
from astrai.quickstart.from_pretrained import (arithmetic_reward, ask, heldout_task, resolve_base,
                                               run_base_quickstart)
from astrai.quickstart.from_scratch import Deadline
from astrai.tokenize import AutoTokenizer

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-5)
STEPS = {"sft": 3, "dpo": 2, "grpo": 2}
MINI = dict(minutes=5, seed=0, steps=STEPS, batch_size=2, window_size=64, dpo_seq_len=64, grpo_seq_len=128,
            grpo_prompts_per_step=2, grpo_group_size=2, grpo_max_new_tokens=4, sft_arithmetic=40, dpo_arithmetic=20,
            grpo_problems=20, eval_problems=6, eval_max_new_tokens=4, ppl_max_tokens=200, ppl_window=64,
            sample_max_new_tokens=4, progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = ["What is 23+45? Work it out column by column, units first. 3+5=8, 2+4=6, so 68",
              "The sea is wide and blue.", "中国的首都是北京。"] * 20
    return AutoTokenizer.train(corpus, vocab_size=300, show_progress=False, min_frequency=1)


def tiny_llama(vocab_size: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab_size, **SHAPE)).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer):
    """A Hugging Face model directory as transformers writes it, with a tokenizer and chat template."""
    path = tmp_path_factory.mktemp("hf-base")
    tiny_llama(tokenizer.vocab_size).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_gguf(path, tokenizer, arch="llama", with_tensors=True):
    """A float32 GGUF file of a random tiny Llama, with the tokenizer's vocabulary, merges and chat template."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    model = json.loads(tokenizer.backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_token_types([3 if t.startswith("<|") and t.endswith("|>") else 1 for t in tokens])
    writer.add_bos_token_id(tokens.index("<|bos|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|pad|>"))
    writer.add_chat_template(tokenizer.chat_template.template_str)
    if with_tensors:
        names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
        layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
        for name, param in tiny_llama(len(tokens)).state_dict().items():
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers."):].split(".", 1)
                target = f"blk.{index}.{layer[rest.rsplit('.', 1)[0]]}.weight"
            else:
                target = names[name]
            writer.add_tensor(target, param.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_teaches_the_working(out):
    """SFT answers with the column working, DPO prefers it to the near miss's, and every
    question carries the instruction to work it out, as the evaluation asks it."""
    conversations = read_jsonl(out / "data" / "arithmetic_sft.jsonl")
    pairs = read_jsonl(out / "data" / "arithmetic_dpo.jsonl")
    prompts = read_jsonl(out / "data" / "arithmetic_grpo.jsonl")
    assert len(conversations) == MINI["sft_arithmetic"] and len(pairs) == MINI["dpo_arithmetic"]
    for record in conversations:
        user, assistant = record["messages"]
        problem = problem_asked(user["content"])
        assert user["content"] == ask(problem) and assistant["content"] == worked_solution(problem)
    for pair in pairs:
        problem = problem_asked(pair["prompt"][0]["content"])
        assert pair["prompt"][0]["content"] == ask(problem)
        assert (pair["chosen"], pair["rejected"]) == (worked_solution(problem), worked_solution(problem, slip=True))
    for record in prompts:
        assert record["prompt"][0]["content"] == ask(problem_asked(record["prompt"][0]["content"]))
    # GRPO's rows hold each whole prompt, as the evaluation asks it (none cut from the left)
    grpo_data = json.loads((out / "stages" / "data" / "done.json").read_text())["grpo"]
    assert grpo_data["prompts"] == MINI["grpo_problems"] and "prompts_truncated" not in grpo_data


def problem_asked(question: str) -> dict:
    """The task's problem behind a question, in the phrasing it was asked in."""
    a, op, b = re.search(r"(\d+)([+-])(\d+)", question).groups()
    style = "en" if question.startswith("What is") else "zh" if "等于多少" in question else "short"
    return arithmetic._problem(int(a), op, int(b), style)


def assert_complete_run(out, summary, base_weights=None):
    names = [s["name"] for s in summary["stages"]]
    assert names == ["base", "sft", "dpo", "grpo"]
    for record in summary["stages"]:
        ev = record["eval"]
        assert set(ev["perplexity"]) == {"en", "zh"} and ev["perplexity"]["en"]["bits_per_byte"] > 0
        task = ev["task"]
        assert task["n"] == MINI["eval_problems"] and 0 <= task["interval"][0] <= task["accuracy"] <= task["interval"][1]
        assert len(ev["samples"]) == 6
    for name, steps in STEPS.items():
        record = next(s for s in summary["stages"] if s["name"] == name)
        assert record["steps"] == steps and (out / "stages" / name / "done.json").is_file()
    assert set(summary["gain_over_base"]) == {"sft", "dpo", "grpo"}
    assert_teaches_the_working(out)
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "Base model:" in report and "| base |" in report and "| GRPO |" in report
    assert json.loads((out / "plan.json").read_text())["steps"] == STEPS
    # what is served is the last stage's model, not the base model
    served = load_file(out / "model" / "model.safetensors")
    grpo = load_file(out / "stages" / "grpo" / "ckpt" / "final" / "model.safetensors")
    base = load_file(out / "base" / "model.safetensors")
    assert served.keys() == grpo.keys() and all(torch.equal(served[k], grpo[k]) for k in served)
    assert any(not torch.equal(served[k], base[k]) for k in served)
    with InferenceEngine.from_pretrained(out / "model") as engine:
        assert isinstance(engine.generate([{"role": "user", "content": "What is 2+3?"}], max_tokens=3), str)
    # the model records how the report scored held-out text, so plain astrai eval repeats its bits per byte
    assert load_eval_config(out / "model") == {"ppl_window": MINI["ppl_window"], "ppl_max_tokens": MINI["ppl_max_tokens"]}
    results = out / "eval.json"
    assert astrai_main(["eval", "--model", str(out / "model"), "--task-problems", "0", "--no-samples",
                        "--out", str(results)]) == 0
    assert same_figures(json.loads(results.read_text())["perplexity"], summary["stages"][-1]["eval"]["perplexity"])


def test_base_run_from_a_hugging_face_directory(hf_dir, tmp_path):
    out = tmp_path / "run"
    summary = run_base_quickstart(out=str(out), base=str(hf_dir), **MINI)
    assert summary["model"]["family"] == "llama" and summary["model"]["finetune"] == "full"
    assert_complete_run(out, summary)


def test_base_run_from_a_gguf_file_with_lora(tokenizer, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tokenizer)
    out = tmp_path / "run"
    summary = run_base_quickstart(out=str(out), base=str(path), finetune="lora", **MINI)
    assert summary["model"]["source"] == str(path) and summary["model"]["finetune"] == "lora"
    assert (out / "stages" / "sft" / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    assert_complete_run(out, summary)


def test_the_checker_reads_the_last_integer_for_every_stage_alike():
    problem = {"answer": "68"}
    assert check_answer(problem, "68") == 1.0
    assert check_answer(problem, "23 + 45 = 68.") == 1.0
    assert check_answer(problem, "The answer is 23.", format_reward=0.1) == 0.1
    assert check_answer(problem, "I do not know.") == 0.0
    assert arithmetic_reward("<|im_start|>user\n45-22= Work it out column by column, units first.<|im_end|>", "45 - 22 = 23") == 1.0
    problems, prompt_of, check = heldout_task(6)
    held = set(task_pools()[1])
    assert all((p["a"], p["op"], p["b"]) in held for p in problems)
    assert prompt_of(problems[0]) == ask(problems[0]) and prompt_of(problems[0]).startswith(problems[0]["prompt"])
    assert check(problems[0], f"= {problems[0]['answer']}") == 1.0


def test_smollm2_resolves_to_the_packaged_gguf(monkeypatch, tokenizer, tmp_path):
    path = write_gguf(tmp_path / "SmolLM2.gguf", tokenizer, with_tensors=False)
    monkeypatch.setattr(from_pretrained, "packaged_gguf", lambda name: path)
    assert resolve_base("smollm2") == (path, "llama")


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file or directory, and not a known model name (known: smollm2)"),
    ("unknown-name", "no such file or directory, and not a known model name"),
    ("gpt2-dir", "model family 'gpt2' is not supported"),
    ("gpt2-gguf", "model family 'gpt2' is not supported"),
    ("not-a-model", "neither a model directory nor a GGUF file"),
])
def test_a_bad_base_is_one_line_and_exit_2(case, message, tokenizer, tmp_path, capsys):
    if case == "missing":
        spec = str(tmp_path / "nowhere")
    elif case == "unknown-name":
        spec = "smollm3"
    elif case == "gpt2-dir":
        (tmp_path / "gpt2").mkdir()
        (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        spec = str(tmp_path / "gpt2")
    elif case == "gpt2-gguf":
        spec = str(write_gguf(tmp_path / "gpt2.gguf", tokenizer, arch="gpt2", with_tensors=False))
    else:
        (tmp_path / "notes.txt").write_text("hello")
        spec = str(tmp_path / "notes.txt")
    out = tmp_path / "run"
    assert astrai_main(["quickstart", "--base", spec, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(ConfigError):
        resolve_base(spec)


def test_flags_of_the_scratch_run_are_refused_with_base(hf_dir, tmp_path, capsys):
    assert astrai_main(["quickstart", "--base", str(hf_dir), "--preset", "tiny-moe", "--out", str(tmp_path / "r")]) == 2
    assert "--preset does not apply with --base" in capsys.readouterr().err
    assert astrai_main(["quickstart", "--finetune", "lora", "--out", str(tmp_path / "r")]) == 2
    assert "add --base PATH" in capsys.readouterr().err


def test_grpo_takes_most_of_the_time_after_sft(hf_dir, tmp_path):
    """On a pretrained base DPO moved held-out accuracy by a point or two while GRPO's gain grew
    with its steps, so after SFT's 55% DPO gets a twentieth of the time and GRPO two fifths."""
    qs = from_pretrained.BaseQuickstart(from_pretrained.BaseSettings(base=str(hf_dir), out=str(tmp_path), minutes=15.0))
    qs.deadline = Deadline(15.0, already_spent=60.0)
    qs.eval_seconds = 10.0
    after_sft = qs.training_seconds_left("sft")
    assert qs.stage_seconds("sft") == pytest.approx(0.55 * after_sft, rel=1e-3)
    dpo = qs.stage_seconds("dpo")
    assert dpo == pytest.approx(qs.training_seconds_left("dpo") * 0.05 / 0.45, rel=1e-3)
    assert qs.stage_seconds("grpo") >= 7.5 * dpo


def test_a_budget_too_short_for_sft_and_grpo_says_so_and_names_the_minutes(hf_dir, tmp_path, monkeypatch, capsys):
    """Zen 1 figures: SFT 17 steps of 8.6 s, GRPO 15 of 20 s in 15 minutes. SFT needs
    (140 - 17) x 8.6 s more, at 55% of each added minute: 32 minutes more, so 50 in all."""
    qs = from_pretrained.BaseQuickstart(from_pretrained.BaseSettings(base=str(hf_dir), out=str(tmp_path), minutes=15.0))
    sft = {"name": "sft", "steps": 17, "planned_steps": 218, "seconds": 17 * 8.6}
    records = [sft, {"name": "dpo", "steps": 2, "seconds": 9.0}, {"name": "grpo", "steps": 15, "planned_steps": 15,
                                                                 "seconds": 300.0}]
    shortfall = qs.report_shortfall(records)
    assert shortfall["steps"] == {"sft": 17, "grpo": 15} and shortfall["needed_steps"] == {"sft": 140, "grpo": 50}
    assert shortfall["step_seconds"] == pytest.approx({"sft": 8.6, "grpo": 20.0}) and shortfall["minutes"] == 50
    # GRPO alone short: (50 - 30) x 20 s at 40% of each added minute is 1,000 s more, so 35 in all
    enough_sft = {"name": "sft", "steps": 150, "planned_steps": 300, "seconds": 600.0}
    assert qs.report_shortfall([enough_sft, {"name": "grpo", "steps": 30, "seconds": 600.0}])["minutes"] == 35
    assert qs.report_shortfall([enough_sft, {"name": "grpo", "steps": 60, "seconds": 600.0}]) is None
    # an SFT that ran all its steps (its data, not the time, ended it) is not short
    assert qs.report_shortfall([{"name": "sft", "steps": 100, "planned_steps": 100, "seconds": 800.0}]) is None
    # a pinned plan set the steps, not the budget
    pinned = from_pretrained.BaseQuickstart(from_pretrained.BaseSettings(base=str(hf_dir), out=str(tmp_path / "p"),
                                                                         minutes=15.0, steps=STEPS))
    assert pinned.report_shortfall(records) is None
    # said as SFT ends, before DPO and GRPO spend the rest
    monkeypatch.setattr(from_pretrained.Quickstart, "train_stage", lambda self, index, name, check_pace=True: sft)
    assert qs.train_stage(0, "sft") is sft
    said = capsys.readouterr().err
    assert "sft: 17 steps in its time (8.6 s each), short of the 140" in said and "--minutes 50 gives them" in said
