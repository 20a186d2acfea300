"""A real model's decode loop on splitkey (issue 49, point 4): each generated token's time, split into the
model's own compute and the attention round trips, and the engine process's memory, against transformers'
own SDPA in the same run.

Run from the repository root (``pip install -e '.[hf,bench]'``)::

    .venv/bin/python benchmarks/hf_decode.py --prompts 1K,4K --sequences 1,4 --tokens 16 --out /tmp/hf.md
    .venv/bin/python benchmarks/hf_decode.py --prompts 4K,32K,128K --sequences 1,8   # the issue's sizes
    .venv/bin/python benchmarks/hf_decode.py --quick                                # smoke run

The model: a Llama built from its config with random weights (no download), ``--layers`` layers,
hidden 512, 8 query heads over 2 kv heads of 64 (GQA), float32. For each prompt length and sequence
count, ``b`` prompts of random tokens (all of that length: no padding) are prefilled in chunks of
``--chunk`` tokens (not timed), then ``--tokens`` greedy steps are timed one by one:

* **splitkey**: ``SplitkeyCache`` on ``splitkey serve --workers 2`` (this machine, loopback). A
  step's time is split into the attention round trips (the wall time inside
  ``Client.attention_batch``: one batch per layer, each item appending the token's keys and asking
  its query) and the rest (the model's own compute and the backend's conversions);
* **SDPA**: transformers' ``sdpa`` attention and ``DynamicCache`` in this process.

Both greedy runs must give the same tokens (checked). Memory: the key and value bytes each cache holds
in this process (``DynamicCache``: its tensors; ``SplitkeyCache``: none, by construction) and this
process's resident set (VmRSS) after the last step; every splitkey run comes before every SDPA run, so
the resident set of the splitkey runs is not the high-water mark of an SDPA cache freed earlier.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import transformers

from benchmarks import common
from service.client import Client
from service.hf import ATTENTION, SplitkeyCache

VOCAB = 1024
SEED = 20261206


class TimedClient(Client):
    """A ``Client`` that adds up the wall time of its batch requests (the attention round trips)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.batch_s = 0.0
        self.batches = 0

    def attention_batch(self, items: Sequence[Any], *, deadline: float | None = None) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return super().attention_batch(items, deadline=deadline)
        finally:
            self.batch_s += time.perf_counter() - t0
            self.batches += 1


@dataclass
class Run:
    """One decode run: per-step seconds, the round trips' share of each, the tokens, memory."""

    step_s: list[float]
    round_trip_s: list[float]
    tokens: torch.Tensor  # [b, tokens]
    kv_bytes: int
    rss: int
    batches_per_step: float = 0.0


def build(layers: int) -> transformers.PreTrainedModel:
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=2**18)
    return transformers.LlamaForCausalLM(config).eval()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def kv_bytes(cache: transformers.Cache) -> int:
    """Bytes of the key and value tensors ``cache`` holds in this process."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


def decode(model: transformers.PreTrainedModel, cache: transformers.Cache, ids: torch.Tensor, args: argparse.Namespace,
           client: TimedClient | None) -> Run:
    """Prefill ``ids [b, n]`` in chunks, then ``args.tokens`` greedy steps, each timed."""
    with torch.inference_mode():
        for lo in range(0, ids.shape[1], args.chunk):
            out = model(input_ids=ids[:, lo:lo + args.chunk], cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)  # [b, 1]
        tokens, step_s, round_trip_s = [token], [], []
        batches = client.batches if client is not None else 0
        for _ in range(args.tokens):
            before = client.batch_s if client is not None else 0.0
            t0 = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            step_s.append(time.perf_counter() - t0)
            round_trip_s.append(client.batch_s - before if client is not None else 0.0)
            tokens.append(token)
    per_step = (client.batches - batches) / args.tokens if client is not None else 0.0
    return Run(step_s, round_trip_s, torch.cat(tokens, dim=1), kv_bytes(cache), rss_bytes(), per_step)


def prompt(b: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(SEED + n + b))


def on_splitkey(model: transformers.PreTrainedModel, url: str, b: int, n: int, args: argparse.Namespace) -> Run:
    model.set_attn_implementation(ATTENTION)
    with TimedClient(url) as client, SplitkeyCache(client, model.config) as cache:
        return decode(model, cache, prompt(b, n), args, client)


def on_sdpa(model: transformers.PreTrainedModel, b: int, n: int, args: argparse.Namespace) -> Run:
    model.set_attn_implementation("sdpa")
    run = decode(model, transformers.DynamicCache(config=model.config), prompt(b, n), args, None)
    gc.collect()
    return run


def median_ms(seconds: Sequence[float]) -> float:
    return common.summarize(seconds).p50 * 1e3


def report(args: argparse.Namespace, runs: dict[tuple[int, int], tuple[Run, Run]], notes: list[str]) -> str:
    rows = []
    for (n, b), (sk, local) in runs.items():
        step, rt = median_ms(sk.step_s), median_ms(sk.round_trip_s)
        rows.append([common.size_label(n), b, f"{step:.1f}", f"{step - rt:.1f}", f"{rt:.1f}",
                     f"{sk.batches_per_step:.0f}", f"{median_ms(local.step_s):.1f}",
                     f"{step / median_ms(local.step_s):.2f}x", "yes" if torch.equal(sk.tokens, local.tokens) else "NO",
                     common.bytes_label(sk.kv_bytes), common.bytes_label(sk.rss), common.bytes_label(local.kv_bytes),
                     common.bytes_label(local.rss)])
    headers = ["prompt", "sequences", "splitkey ms/token", "model and backend", "attention round trips",
               "requests/token", "SDPA ms/token", "splitkey / SDPA", "same tokens", "splitkey KV held",
               "splitkey RSS", "SDPA KV held", "SDPA RSS"]
    lines = [f"### Hugging Face decode on splitkey ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             (f"`python benchmarks/hf_decode.py {' '.join(args.argv)}`: Llama, {args.layers} layers, hidden 512, "
              f"h_q 8, h_kv 2, d 64, float32, random weights; prefill in chunks of {args.chunk} (not timed), "
              f"{args.tokens} greedy steps timed (medians); `splitkey serve --workers 2` on the same machine."), "",
             common.markdown_table(headers, rows), "", *common.machine_lines(),
             f"- torch {torch.__version__}, transformers {transformers.__version__}", *notes]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 256-token prompt, 1 and 2 sequences, 4 steps: a smoke run")
    p.add_argument("--prompts", type=common.parse_keys, default=common.parse_keys("1K,4K"),
                   help="prompt lengths in tokens (default 1K,4K)")
    p.add_argument("--sequences", type=lambda t: [common.positive(x) for x in t.split(",")], default=[1, 4],
                   help="sequence counts (default 1,4)")
    p.add_argument("--tokens", type=common.positive, default=16, help="greedy steps timed (default 16)")
    p.add_argument("--layers", type=common.positive, default=4)
    p.add_argument("--chunk", type=common.positive, default=1024, help="prefill chunk in tokens (default 1024)")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.prompts, args.sequences, args.tokens, args.layers, args.chunk = [256], [1, 2], 4, 2, 128
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    torch.set_num_threads(1)  # the model on one core, the service's workers on the others
    model = build(args.layers)
    t0 = time.monotonic()
    cases = [(n, b) for n in args.prompts for b in args.sequences]
    with tempfile.TemporaryDirectory(prefix="splitkey-hf-bench-") as tmp, \
            common.splitkey_server(Path(tmp), workers=2) as url:
        remote = {case: on_splitkey(model, url, case[1], case[0], args) for case in cases}
    runs = {case: (remote[case], on_sdpa(model, case[1], case[0], args)) for case in cases}
    notes = [("- the model runs on one thread (`torch.set_num_threads(1)`); the service's two workers and front "
              "end share the other cores"), f"- load average after: {common.load_average()}",
             f"- whole run: {time.monotonic() - t0:.0f} s"]
    common.emit_report(report(args, runs, notes), args.out)
    return 0 if all(torch.equal(sk.tokens, local.tokens) for sk, local in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
