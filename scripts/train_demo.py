"""Train the bundled demo model and adapters (moelora/demo/) on CPU, in about 14 minutes on one core.

A tiny Qwen3-MoE (transformers' Qwen3MoeForCausalLM) with a byte-level tokenizer (256 byte tokens,
no merges, four special tokens) learns to copy a line of random lowercase words (the `copy`
task); then one PEFT LoRA adapter per transformation in moelora.demo.tasks (`upper`, `reverse`,
`shift`) is fine-tuned on the frozen base, with LoRA on q/k/v/o_proj and on the routed experts
(`target_parameters`). Every model and adapter is then reloaded from disk and scored by greedy
exact match on held-out inputs (the first 10_000 lines of tasks.heldout_inputs are excluded
from training), and moelora/demo/README.md records the run.

    .venv/bin/python scripts/train_demo.py       # writes moelora/demo/{model,adapters,README.md}
    .venv/bin/python scripts/train_demo.py --out /tmp/demo --base-steps 100 --probe-n 50   # a try

transformers, peft and tokenizers are needed here (dev extra); the engine needs only the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shutil
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moelora.demo import tasks  # noqa: E402

SPECIAL_TOKENS = (tasks.ENDOFTEXT, tasks.IM_START, tasks.IM_END, tasks.PAD)  # ids 256, 257, 258, 259
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
HELDOUT_EXCLUDED = 10_000
LETTER_FREQUENCIES = (1, 3, 5, 7, 9, 11)  # the 6 of 1..12 that keep distinct letters most apart


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 80  # 2*I != H and I != H: every expert tensor has a shape of its own
    batch: int = 32
    base_steps: int = 1800
    base_upper_words: float = 0.2
    base_lr: float = 3e-3
    # upper/shift pass 98% by step 150; reverse (an algorithm, not a letter map) needed 500-900
    adapter_steps: str = "upper=300,reverse=900,shift=300"
    adapter_lr: float = 6e-3
    rank: int = 16  # rank 8 reached 44-80% in 400 steps: a letter-to-letter map needs the rank
    alpha: int = 32
    eval_n: int = 200
    log_every: int = 50
    probe_n: int = 0  # > 0: also print greedy exact match on this many held-out lines at each log
    # One thread: on the shared 2-core CI box, 2 OpenMP threads measured 7.7 s per batch-16 step
    # (threads wait on each other when descheduled) against 0.25 s with one.
    threads: int = 1


# ---------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """Byte-level BPE without merges: token id == byte value; the special tokens follow (256..259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from moelora.engine.tiktoken_vocab import byte_chars

    vocab = {ch: b for b, ch in enumerate(byte_chars())}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    flags = dict.fromkeys(("lstrip", "normalized", "rstrip", "single_word"), False)
    added = {str(tok.token_to_id(t)): {"content": t, **flags, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "bos_token": None,
        "eos_token": tasks.IM_END,
        "pad_token": tasks.PAD,
        "unk_token": None,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------- model and data


def build_model(cfg: TrainConfig, tok):
    import transformers as tf

    hf_cfg = tf.Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.expert_intermediate,
        intermediate_size=2 * cfg.expert_intermediate,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        router_aux_loss_coef=0.01,
        bos_token_id=tok.token_to_id(tasks.ENDOFTEXT),
        eos_token_id=tok.token_to_id(tasks.IM_END),
        pad_token_id=tok.token_to_id(tasks.PAD),
    )
    torch.manual_seed(cfg.seed)
    model = tf.Qwen3MoeForCausalLM(hf_cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(letter_embeddings(tok, cfg.hidden, cfg.seed))
    return model


def letter_embeddings(tok, hidden: int, seed: int) -> torch.Tensor:
    """Fixed input embeddings with structure, so each adapter's letter-to-letter map is low rank.

    Letter i (a=0 .. z=25) sits at angle 2*pi*f*i/26 on one circle per frequency f in
    LETTER_FREQUENCIES (on those 12 dimensions distinct letters have cos <= 0.083), plus a case
    direction (+ upper, - lower) and a shared letter direction. `shift` is then a rotation of
    12 dimensions and `upper` one added direction. With freely learned embeddings, rank-16 adapters
    of `upper` and `shift` stalled below 50% in 500 steps on one base and passed 95% on another.
    Other tokens get random directions orthogonal to the letters. Every row has norm 1.
    """
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g, dtype=torch.float64))
    n_circle = 2 * len(LETTER_FREQUENCIES)
    case_dir, letter_dir, rest = basis[:, n_circle], basis[:, n_circle + 1], basis[:, n_circle + 2 :]
    emb = torch.randn(tok.get_vocab_size(), rest.shape[1], generator=g, dtype=torch.float64) @ rest.T
    for i, (low, up) in enumerate(zip(string.ascii_lowercase, string.ascii_uppercase, strict=True)):
        angles = torch.tensor([2 * math.pi * f * i / 26 for f in LETTER_FREQUENCIES], dtype=torch.float64)
        circle = torch.stack([angles.cos(), angles.sin()], dim=1).reshape(-1) / len(LETTER_FREQUENCIES) ** 0.5
        for ch, case in ((low, -1.0), (up, 1.0)):
            emb[tok.token_to_id(ch)] = basis[:, :n_circle] @ circle + 0.5 * case * case_dir + 0.3 * letter_dir
    return (emb / emb.norm(dim=1, keepdim=True)).float()


def training_batches(seed: int, batch: int, upper_words: float, pool: int = 8):
    """Endless batches of fresh input lines, none among the first HELDOUT_EXCLUDED held-out ones.

    Each word is capitalised with probability `upper_words`: the base model must see capitals,
    or the rows of its (untied, never adapted) lm_head for A-Z stay untrained and the `upper`
    adapter cannot tell one capital from another. Lines are drawn `pool` batches at a time and
    sorted by length, so a batch pads little."""
    excluded = set(tasks.heldout_inputs(HELDOUT_EXCLUDED))
    rng = random.Random(seed)
    while True:
        lines = []
        while len(lines) < pool * batch:
            text = tasks.random_input(rng)
            if text not in excluded:
                lines.append(" ".join(w.upper() if rng.random() < upper_words else w for w in text.split(" ")))
        lines.sort(key=len)
        chunks = [lines[i : i + batch] for i in range(0, len(lines), batch)]
        rng.shuffle(chunks)
        yield from chunks


def make_batch(tok, task: str, texts: list[str]):
    """Right-padded (input_ids, attention_mask, labels); loss only on the answer and its <|im_end|>."""
    pad = tok.token_to_id(tasks.PAD)
    prompts = tok.encode_batch([tasks.user_prompt(t) for t in texts])
    answers = tok.encode_batch([tasks.transform(task, t) + tasks.IM_END for t in texts])
    rows = [(p.ids + a.ids, len(p.ids)) for p, a in zip(prompts, answers, strict=True)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def train(model, tok, task: str, steps: int, lr: float, cfg: TrainConfig, seed: int, router_loss: bool):
    """AdamW, linear warm-up then cosine decay, fresh random lines every step.

    Returns (wall, CPU) seconds."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    batches = training_batches(seed, cfg.batch, cfg.base_upper_words if task == "copy" else 0.0)
    probe, t0, c0 = tasks.heldout_inputs(cfg.probe_n), time.time(), time.process_time()
    model.train()
    for step in range(steps):
        input_ids, mask, labels = make_batch(tok, task, next(batches))
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, output_router_logits=router_loss)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % cfg.log_every == 0 or step == steps - 1:
            line = f"  [{task}] step {step:4d}  loss {out.loss.item():.4f}  {time.time() - t0:6.1f}s"
            if cfg.probe_n and step > 0:
                line += f"  exact match {exact_match(model, tok, task, probe):.2f}"
                model.train()
            print(line, flush=True)
    model.eval()
    return time.time() - t0, time.process_time() - c0


def adapter_steps(cfg: TrainConfig) -> dict[str, int]:
    steps = {name: int(n) for name, n in (item.split("=") for item in cfg.adapter_steps.split(","))}
    if set(steps) != set(tasks.ADAPTERS):
        raise ValueError(f"--adapter-steps must name each of {tasks.ADAPTERS}: {cfg.adapter_steps!r}")
    return steps


def lora_config(cfg: TrainConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=list(ATTENTION_TARGETS),
        target_parameters=list(EXPERT_TARGETS),
    )


def check_adapter(path: Path, cfg: TrainConfig) -> None:
    """The saved adapter must hold LoRA on every attention projection and on both expert tensors.

    PEFT nests one ParamWrapper per targeted parameter and its keys do not name the parameter:
    `mlp.experts.base_layer.lora_*` is gate_up_proj (wrapped first), `mlp.experts.lora_*` is down_proj.
    """
    from safetensors import safe_open

    saved = json.loads((path / "adapter_config.json").read_text())
    targets = (set(saved["target_modules"]), set(saved["target_parameters"]))
    if targets != (set(ATTENTION_TARGETS), set(EXPERT_TARGETS)):
        raise RuntimeError(f"PEFT rewrote the targets of {path.name}: {targets}")
    er, h, i = cfg.experts * cfg.rank, cfg.hidden, cfg.expert_intermediate
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for layer in range(cfg.layers):
        prefix = f"base_model.model.model.layers.{layer}."
        expected = {
            "self_attn.q_proj": ((cfg.rank, h), (q, cfg.rank)),
            "self_attn.k_proj": ((cfg.rank, h), (kv, cfg.rank)),
            "self_attn.v_proj": ((cfg.rank, h), (kv, cfg.rank)),
            "self_attn.o_proj": ((cfg.rank, q), (h, cfg.rank)),
            "mlp.experts.base_layer": ((er, h), (2 * i, er)),
            "mlp.experts": ((er, i), (h, er)),
        }
        for name, (a_shape, b_shape) in expected.items():
            got = (shapes.get(f"{prefix}{name}.lora_A.weight"), shapes.get(f"{prefix}{name}.lora_B.weight"))
            if got != (a_shape, b_shape):
                raise RuntimeError(
                    f"adapter {path.name}: {prefix}{name} LoRA A/B shapes {got}, expected {(a_shape, b_shape)}"
                )
    if len(shapes) != 12 * cfg.layers:
        raise RuntimeError(f"adapter {path.name} has {len(shapes)} tensors, expected {12 * cfg.layers}")


# ---------------------------------------------------------------------------- evaluation


@torch.no_grad()
def exact_match(model, tok, task: str, texts: list[str], batch: int = 100) -> float:
    """Greedy decoding (left-padded batches) until <|im_end|>; the fraction of exactly right answers."""
    pad, eos = tok.token_to_id(tasks.PAD), tok.token_to_id(tasks.IM_END)
    right = 0
    for start in range(0, len(texts), batch):
        chunk = texts[start : start + batch]
        enc = [e.ids for e in tok.encode_batch([tasks.user_prompt(t) for t in chunk])]
        width = max(map(len, enc))
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in enc])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in enc])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for text, row in zip(chunk, out[:, width:].tolist(), strict=True):
            answer = tok.decode(row[: row.index(eos)], skip_special_tokens=False) if eos in row else None
            right += answer == tasks.transform(task, text)
    return right / len(texts)


def evaluate_saved(out: Path, cfg: TrainConfig) -> dict[str, dict[str, float]]:
    """Reload the saved model and each adapter from disk; score them on held-out inputs, computing
    in fp32 and in bf16 (what a GPU engine runs)."""
    import transformers as tf
    from peft import PeftModel
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "model" / "tokenizer.json"))
    texts = tasks.heldout_inputs(cfg.eval_n)
    scores = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        base = tf.AutoModelForCausalLM.from_pretrained(out / "model", dtype=dtype).eval()
        scores[label] = {"copy": exact_match(base, tok, "copy", texts)}
        for name in tasks.ADAPTERS:
            model = PeftModel.from_pretrained(base, out / "adapters" / name).to(dtype).eval()
            scores[label][name] = exact_match(model, tok, name, texts)
            base = model.unload()
    return scores


# ---------------------------------------------------------------------------- record


def _size(path: Path) -> str:
    n = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    return f"{n / 2**20:.2f} MiB"


def write_readme(out: Path, cfg: TrainConfig, command: str, times: dict, accuracy: dict) -> None:
    """moelora/demo/README.md: how the assets were made and how well they do, from this very run."""
    import peft
    import transformers

    hf = json.loads((out / "model" / "config.json").read_text())
    rows = "\n".join(
        f"| `{t}` | {'base model' if t == 'copy' else f'adapters/{t}'} | {accuracy['fp32'][t]:.3f} | "
        f"{accuracy['bf16'][t]:.3f} | {times[t][0]:.0f} s / {times[t][1]:.0f} s |"
        for t in tasks.TASKS
    )
    fields = ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    adapter_size = _size(out / "adapters" / tasks.ADAPTERS[0] / "adapter_model.safetensors")
    (out / "README.md").write_text(f"""# moelora demo: a tiny Qwen3-MoE and three LoRA adapters

Written by `scripts/train_demo.py` in the same run that made the files here; rerun it rather than
editing. The base model copies a line of {tasks.MIN_WORDS}-{tasks.MAX_WORDS} random lowercase words of \
{tasks.MIN_LETTERS}-{tasks.MAX_LETTERS} letters; each adapter
transforms the whole line, so every answer token depends on the input. `tasks.py` holds the
definitions and the held-out input generator.

| task | weights | exact match, fp32 | exact match, bf16 | training time (wall / CPU) |
|---|---|---|---|---|
{rows}

Exact match: greedy decoding up to `<|im_end|>` by transformers + PEFT from the saved files (bf16
weights, computed in fp32 or in bf16) on `tasks.heldout_inputs({cfg.eval_n})` (seed {tasks.HELDOUT_SEED}); the
first {HELDOUT_EXCLUDED} lines of that generator were kept out of training.

## Prompt

`tasks.user_prompt(text)`, the string the chat template renders with add_generation_prompt:
`<|im_start|>user\\n{{text}}<|im_end|>\\n<|im_start|>assistant\\n`. The answer ends with
`<|im_end|>`, the config's eos_token_id.

## Files ({_size(out)} in all)

- `model/`: transformers' save_pretrained of Qwen3MoeForCausalLM in bf16 \
({_size(out / "model" / "model.safetensors")}; Hub-style
  per-expert keys), `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`,
  `chat_template.jinja`. {hf["num_hidden_layers"]} layers, hidden {hf["hidden_size"]}, \
{hf["num_attention_heads"]} query / {hf["num_key_value_heads"]} kv heads of
  {hf["head_dim"]}, {cfg.experts} experts of intermediate {hf["moe_intermediate_size"]}, \
top-{hf["num_experts_per_tok"]}, norm_topk_prob, untied lm_head, vocab {hf["vocab_size"]}.
- Tokenizer: byte level with no merges, token id = byte value (0-255); `<|endoftext|>` 256,
  `<|im_start|>` 257, `<|im_end|>` 258 (eos), `<|pad|>` 259 (pad).
- `adapters/{{{",".join(tasks.ADAPTERS)}}}/`: PEFT LoRA, r={cfg.rank}, alpha={cfg.alpha}, fp32 \
({adapter_size} each), on
  `self_attn.{{q,k,v,o}}_proj` (target_modules) and the routed experts' fused `gate_up_proj` and
  `down_proj` (target_parameters). PEFT nests one wrapper per expert parameter and the keys do not
  name it: `mlp.experts.base_layer.lora_{{A,B}}` is gate_up_proj (A `[E*r, H]`, B `[2I, E*r]`),
  `mlp.experts.lora_{{A,B}}` is down_proj (A `[E*r, I]`, B `[H, E*r]`); expert e uses
  `A[e*r:(e+1)*r]` and `B[:, e::E]`.

## How it was made

    {command}

{versions}; CPU, {cfg.threads} thread(s). Seeded: the same versions on the same machine remake the same
files. Whole run {times["total"][0] / 60:.1f} min wall ({times["total"][1] / 60:.1f} min CPU), \
of which evaluation {times["eval"][0]:.0f} s.
Config: {fields}.

The input embeddings are fixed (never trained) at a structured init: letter i (a=0..z=25) lies at
angle 2*pi*f*i/26 on one circle per f in {LETTER_FREQUENCIES}, plus a case direction and a shared letter
direction; other tokens get random directions orthogonal to those. So `shift` is a rotation of 12
dimensions and `upper` one added direction, which rank-{cfg.rank} LoRA learns in ~150 steps (with
learned embeddings it stalled on some seeds). The base model trains on `copy` with each word
upper-cased with probability {cfg.base_upper_words} (otherwise the lm_head rows of A-Z, which no adapter
touches, stay untrained), with the router load-balancing loss (the logged loss includes it); it is
then rounded to bf16, saved and frozen, and each adapter trains on that frozen bf16 base. All runs:
AdamW, warm-up then cosine decay, gradient clipping 1.0, fresh random lines every step, loss only on
the answer tokens and the `<|im_end|>`.
""")


# ---------------------------------------------------------------------------- main


def run(cfg: TrainConfig, out: Path) -> dict:
    """Train and save the base model, then each adapter; return times (wall and CPU seconds)."""
    from peft import get_peft_model

    tok = build_tokenizer()
    model = build_model(cfg, tok)
    model.get_input_embeddings().requires_grad_(False)  # keep the letter structure (letter_embeddings)
    times = {"copy": train(model, tok, "copy", cfg.base_steps, cfg.base_lr, cfg, cfg.seed, router_loss=True)}
    # Round to bf16 now, so the adapters learn on exactly the weights that are saved.
    model = model.to(torch.bfloat16)
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir)
    save_tokenizer(tok, model_dir)
    model = model.to(torch.float32).requires_grad_(False)
    for i, name in enumerate(tasks.ADAPTERS):
        torch.manual_seed(cfg.seed + 1 + i)
        peft_model = get_peft_model(model, lora_config(cfg))
        times[name] = train(
            peft_model, tok, name, adapter_steps(cfg)[name], cfg.adapter_lr, cfg, cfg.seed + 1 + i, router_loss=False
        )
        adapter_dir = out / "adapters" / name
        shutil.rmtree(adapter_dir, ignore_errors=True)
        peft_model.save_pretrained(adapter_dir)
        (adapter_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
        check_adapter(adapter_dir, cfg)
        model = peft_model.unload()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "moelora" / "demo")
    for field in dataclasses.fields(TrainConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    torch.set_num_threads(cfg.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    clock = (time.time(), time.process_time())
    times = run(cfg, args.out)
    eval_clock = (time.time(), time.process_time())
    accuracy = evaluate_saved(args.out, cfg)
    times["eval"] = (time.time() - eval_clock[0], time.process_time() - eval_clock[1])
    times["total"] = (time.time() - clock[0], time.process_time() - clock[1])
    command = "python scripts/train_demo.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    write_readme(args.out, cfg, command, times, accuracy)
    print(json.dumps({"seconds (wall, cpu)": times, "exact_match": accuracy}, indent=2))


if __name__ == "__main__":
    main()
