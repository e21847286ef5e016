"""Rollout benchmark: the HF engine's decode paths vs one plain ``model.generate`` call, tokens/s.

    .venv/bin/python benchmarks/rollout.py --threads 1         # quickstart-size Qwen2, CPU, ~40 s
    .venv/bin/python benchmarks/rollout.py --max-batch-size 64 --threads 1   # bucketed: 4 batches of 64
    .venv/bin/python benchmarks/rollout.py --device cuda --dtype bfloat16 --shape 0.5b   # GPU target

Shapes (from scratch, Qwen2): ``quickstart`` hidden 128, 2 layers, 4/2 heads, MLP 256, the ~512-token
vocabulary of a tokenizer trained on arithmetic-like text, prompts of 20–60 tokens; ``0.5b`` the
Qwen2.5-0.5B geometry (hidden 896, 24 layers, 14/2 heads, MLP 4864, vocabulary 151,936 — the
tokenizer's ids are a subset; ``--vocab`` lowers it if memory needs), prompts of 128 tokens.
Workload: ``--prompts`` prompts, ``--n`` samples each, ``--max-new-tokens`` new tokens, sampling at
T = 1, no top-k/top-p.
- baseline: the same prompts, each repeated n times, as ONE left-padded batch through
  ``model.generate(do_sample=True, top_k=0, use_cache=True)`` (transformers' defaults: dynamic cache);
- engine-<path>: ``HFEngine(model, tok, max_batch_size=..., decode=<path>)`` for each ``--paths``
  (``generate``: ``HFEngine.generate_reference``)
  (length-bucketed batches, behaviour log-probs, stop handling, results in request order):
  ``generate`` is the engine before issue 16 (transformers generate + static cache, eager),
  ``loop`` its own eager decode loop, ``compiled`` the CUDA-graph decode step (CUDA only; elsewhere
  it runs the loop). The compiled path prints how many graphs it compiled and any fallback.
Both count the tokens they actually generated (up to and including eos), so early stops are fair.
Each side runs once untimed (warm-up: compiles happen there), then ``--repeats`` times alternately;
the best time of each is reported. On a shared 2-core box use ``--threads 1``: oversubscribed
threads make every side 10× slower.

``--shape 0.5b --vocab 32000`` runs on CPU (tiny workloads only), compiled path included.

``--engines vllm`` (or ``hf,vllm``) adds the vLLM engine on the same model and prompts, built with
``make_engine("vllm", ...)``: in this process where vllm imports (run the script with the vLLM
environment's interpreter, ``.venv-vllm/bin/python``, as below), else through its subprocess (the
pipeline's shape, JSON over pipes). Its engine start (import, load, warm-up) is timed apart; its
tokens/s come from the same repeats as the others (its CPU seconds are spent in vLLM's own processes:
only its wall-clock figures compare). ``rollout.name: auto`` picks between the engines per device from
its figures (:data:`verl_core.rollout.registry.AUTO_ENGINE`).

    .venv-vllm/bin/python benchmarks/rollout.py --threads 1 --engines hf,vllm --paths loop
    .venv-vllm/bin/python benchmarks/rollout.py --threads 1 --engines hf,vllm --paths loop --shape cpu-large

Figures measured so far: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections.abc import Callable
from functools import partial

import torch
from _hw import device_name, matmul_flops, matmul_params, of_dense_peak, peak_memory_bytes, peak_memory_label

from verl_core.config import RolloutConfig
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.loading import ScratchSpec, count_parameters, init_causal_lm, scratch_config
from verl_core.rollout import HFEngine, RolloutEngine, SamplingParams, make_engine
from verl_core.rollout.vllm_spec import VLLMSpec

NAMES = (  # noqa: SIM905
    "Tom Ann Bob Eve Max Lia Sam Joe Kim Ray Ada Ben Cal Dan Eli Fay Gus Hal Ivy Jan Natalia Weng Betty "
    "Julie James Albert Mark Randy Joy Alexis Tina Carla Emily Ken Marie Lisa Bill Greg Jasmine"
).split()
ITEMS = (  # noqa: SIM905
    "apples pears coins books cards shells pens cups eggs rocks bikes boxes clips stamps marbles stickers "
    "cookies pages dollars hours minutes miles tickets flowers plants oranges bananas candies toys chairs "
    "tables pencils buttons bottles baskets cakes pies muffins sandwiches shirts shoes hats"
).split()
VERBS = "has buys finds sells gives loses gets makes eats keeps collects bakes reads earns saves".split()  # noqa: SIM905


def arithmetic_texts(n: int, seed: int) -> list[str]:
    """Word problems with a worked answer, e.g. "Ann has 12 pens and buys 7 more. ... 12 + 7 = 19"."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        op = rng.choice(["+", "-", "*"])
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        texts.append(
            f"Question: {who} {rng.choice(VERBS)} {a} {item} and {rng.choice(VERBS)} {b} more {item}. "
            f"How many {item} now? Answer: {a} {op} {b} = {result}. The answer is {result}."
        )
    return texts


SHAPES = {  # name → (ScratchSpec, vocabulary or None for the tokenizer's, prompt lengths)
    "quickstart": (ScratchSpec("qwen2", 128, 2, 4, 2, 256, 256), None, (20, 60)),
    "0.5b": (ScratchSpec("qwen2", 896, 24, 14, 2, 4864, 1024), 151936, (128, 128)),
    # a larger model a CPU still rolls out in seconds: ~25M parameters, 8 heads of 64
    "cpu-large": (ScratchSpec("qwen2", 512, 6, 8, 2, 1408, 1024), 32000, (64, 128)),
}


def make_prompts(tok: object, n: int, seed: int, lengths: tuple[int, int] = (20, 60)) -> list[list[int]]:
    """``n`` prompts of ``lengths`` tokens (inclusive range) cut from arithmetic text."""
    rng = random.Random(seed)
    long_ids: list[int] = [
        t
        for text in arithmetic_texts(200, seed + 1)
        for t in tok.encode(text + "\n", add_special_tokens=False)  # type: ignore[attr-defined]
    ]
    prompts = []
    for _ in range(n):
        length = rng.randint(*lengths)
        start = rng.randint(0, len(long_ids) - length)
        prompts.append(long_ids[start : start + length])
    return prompts


def baseline(model: torch.nn.Module, prompts: list[list[int]], n: int, max_new: int, eos: int) -> int:
    """One left-padded batch of len(prompts)·n rows; returns the generated token count."""
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    ids = torch.tensor([[eos] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos,
            use_cache=True,
        )
    new = out[:, width:].tolist()
    return sum(r.index(eos) + 1 if eos in r else len(r) for r in new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shape", default="quickstart", choices=sorted(SHAPES))
    ap.add_argument("--vocab", type=int, default=0, help="override the shape's vocabulary size (0: keep)")
    ap.add_argument("--paths", default="generate,loop,compiled", help="engine decode paths, comma-separated")
    ap.add_argument("--engines", default="hf", help="hf, vllm or hf,vllm (the HF engine runs --paths)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM KV cache on CPU (GiB)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    tok = train_tokenizer(arithmetic_texts(3000, 0), 512)
    spec, vocab, lengths = SHAPES[args.shape]
    vocab = args.vocab or vocab or len(tok)
    config = scratch_config(spec, vocab, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = init_causal_lm(config, seed=0, dtype=args.dtype).to(args.device).eval()
    model.config.use_cache = True  # as a saved model says: transformers' generate default
    prompts = make_prompts(tok, args.prompts, seed=0, lengths=lengths)
    device = torch.device(args.device)
    name = device_name(device)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    print(
        f"device: {args.device} ({name}), {args.dtype}; shape {args.shape}: {count_parameters(model):,} "
        f"params, vocab {vocab}; {args.prompts} prompts ({min(map(len, prompts))}–{max(map(len, prompts))} "
        f"tokens) × n={args.n}, max_new_tokens {args.max_new_tokens}, max_batch_size {args.max_batch_size}, "
        f"torch threads {torch.get_num_threads()}"
    )

    runs: dict[str, Callable[[], int]] = {
        "baseline": lambda: baseline(model, prompts, args.n, args.max_new_tokens, tok.eos_token_id)
    }
    engines = {}
    wanted = args.engines.split(",")
    for path in args.paths.split(",") if "hf" in wanted else []:
        reference = path == "generate"  # HFEngine.generate_reference: transformers generate, same sampler
        engines[path] = HFEngine(
            model, tok, max_batch_size=args.max_batch_size, decode="loop" if reference else path
        )
        runs[f"engine-{path}"] = partial(_engine_run, engines[path], prompts, params, reference)
    if "vllm" in wanted:
        t0 = time.perf_counter()
        r = RolloutConfig()  # the schema's vLLM settings, but the benchmark's own
        spec = VLLMSpec(
            dtype=args.dtype, trust_remote_code=False, tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib,
            cpu_kv_cache_gib=args.kv_cache_gib, enforce_eager=args.vllm_eager,
            max_model_len=max(lengths) + args.max_new_tokens, weight_sync_bucket_mb=r.weight_sync_bucket_mb,
        )  # fmt: skip
        vllm = make_engine("vllm", model, tok, spec=spec, vllm_python=r.vllm_python)
        print(f"vllm engine ({type(vllm).__name__}) started in {time.perf_counter() - t0:.1f} s")
        runs["vllm"] = partial(_engine_run, vllm, prompts, params)
    best = dict.fromkeys(runs, float("inf"))
    cpu = dict.fromkeys(runs, float("inf"))  # process CPU seconds: steadier than wall time on a shared box
    tokens = dict.fromkeys(runs, 0)
    for run in runs.values():  # warm-up (and the compiled path's compiles)
        run()
    for _ in range(args.repeats):
        for k, run in runs.items():
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            tokens[k] = run()
            _sync(device)
            best[k] = min(best[k], time.perf_counter() - t0)
            cpu[k] = min(cpu[k], time.process_time() - c0)

    rate = {k: tokens[k] / best[k] for k in best}
    matmul = matmul_flops(device, getattr(torch, args.dtype))
    per_token = 2 * matmul_params(
        model
    )  # forward FLOPs of one generated token (attention, prefill not counted)
    print(
        f"same-run matmul rate ({args.dtype}, 2048²): {matmul / 1e12:.3f} TFLOP/s; model FLOPs = 2·N per "
        f"generated token, N = {per_token // 2:,} Linear weights; peak memory "
        f"{peak_memory_bytes(device) / 2**30:.2f} GiB ({peak_memory_label(device)})"
    )
    for k in runs:
        achieved = per_token * rate[k]
        elsewhere = " (vLLM's work runs in its own processes)" if k == "vllm" else ""
        print(
            f"{k:>16}: {tokens[k]:7d} tokens in {best[k]:7.2f} s = {rate[k]:9.0f} tok/s "
            f"(process CPU {cpu[k]:6.2f} s = {tokens[k] / cpu[k]:9.0f} tok/CPU-s); "
            f"{achieved / 1e12:.4f} TFLOP/s = {100 * achieved / matmul:.1f}% of matmul"
            f"{of_dense_peak(achieved, device)}{elsewhere}"
        )
    for path, engine in engines.items():
        step = engine.compiled_step
        extra = f"; {step.compiles} graphs compiled" if step else ""
        if step and step.fallback:
            extra += f"; fell back to eager: {step.fallback}"
        print(f"engine-{path}: ran as {engine.decode}{extra}")
        _ratio(f"engine-{path}", "baseline", rate, tokens, cpu)
    if "vllm" in runs:
        for k in runs:
            if k != "vllm":
                print(f"vllm / {k}: {rate['vllm'] / rate[k]:.2f}× wall")
    if "generate" in engines:
        for path in engines:
            if path != "generate":
                _ratio(f"engine-{path}", "engine-generate", rate, tokens, cpu)


def _ratio(a: str, b: str, rate: dict[str, float], tokens: dict[str, int], cpu: dict[str, float]) -> None:
    """Speed of ``a`` over ``b``: tokens/s on the wall clock and per process-CPU second."""
    per_cpu = (tokens[a] / cpu[a]) / (tokens[b] / cpu[b])
    print(f"{a} / {b}: {rate[a] / rate[b]:.2f}× wall, {per_cpu:.2f}× per CPU second")


def _engine_run(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, reference: bool = False
) -> int:
    generate = engine.generate_reference if reference else engine.generate  # type: ignore[attr-defined]
    return sum(len(c.response_ids) for c in generate(prompts, params))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
