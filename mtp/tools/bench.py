"""Benchmark mtp against the fastest plain decoder and Hugging Face prompt-lookup decoding (when mtp's own prompt
lookup is on, against mtp with its heads alone too; with --against, against other drafters), interleaved prompt
by prompt in one process: tau, tokens/s, speedups and the accepted candidates that came from the heads and from
lookup, per category; when greedy, a check that every mtp output equals plain `generate`'s. With --temperature > 0
all sample (the same temperature, top-k and top-p).

Plain decoding is timed twice over when the products mtp measured fastest for one row (`mtp.linears`) are not the
usual ones: `plain`, `generate` as users run it, and `plain_fast`, `generate` with mtp's products; `vs fastest
plain` is against the faster of the two in each row of the table. Where mtp chose the usual product for one row,
the two are the same computation and `plain` alone is timed. Prompt lookup runs with mtp's products.

    python -m mtp.tools.bench --drafter DRAFTER --questions data/mt_bench.jsonl --limit 16 --max-new-tokens 128

With --llama-cpp FILE.gguf: llama.cpp's plain decoding of that file too (`LlamaCpp`), the engine a CPU user would
otherwise run, on the same prompt tokens and threads, in the same rounds.

With --batch-size B [B ...]: total tokens/s of mtp and of plain `generate` answering B prompts at a time, against
one at a time (see `bench_batches`).
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import mtp
from mtp.base import eos_ids
from mtp.decoding.acceptance import Acceptance
from mtp.decoding.costs import describe
from mtp.decoding.decoder import Decoder, GenerationResult
from mtp.decoding.lookup import add_lookup_arguments, lookup_from
from mtp.decoding.sampling import Sampling, add_sampling_arguments, sampling_from
from mtp.decoding.tree import TREE_HELP
from mtp.linears import narrow_counts, usual_linears
from mtp.machine import device_name
from mtp.quantized import add_weights_argument
from mtp.tools.cli import user_errors
from mtp.training.rows import read_rows

# plain `generate` with the usual products, with mtp's (when they differ), and mtp's compiled plain step (when on)
PLAIN = ("plain", "plain_fast", "plain_compiled")


def timed_generate(
    model, prompts: list[torch.Tensor], max_new_tokens: int, sampling: Sampling, batch_size: int = 1, **options
) -> tuple[list[list[int]], float]:
    """Plain `generate` (or prompt lookup with options) of `prompts` (each (1, T)), `batch_size` at a time, left-
    padded: each prompt's new tokens without the EOS, and the seconds of all."""
    if not sampling.greedy:
        options |= dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    eos = eos_ids(model)
    pad_id = next((t for t in [model.generation_config.pad_token_id, *eos] if t is not None), 0)
    outputs, start = [], time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        length = max(input_ids.shape[1] for input_ids in chunk)
        lefts = [length - ids.shape[1] for ids in chunk]  # padding before each prompt
        input_ids = torch.cat([F.pad(ids, (left, 0), value=pad_id) for ids, left in zip(chunk, lefts, strict=True)])
        attention_mask = (torch.arange(length) >= torch.tensor(lefts)[:, None]).long().to(input_ids.device)  # (B, T)
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            **({"do_sample": False} | options),
        )[:, length:]
        outputs += [row[: next((i for i, t in enumerate(row) if t in eos), len(row))] for row in out.tolist()]
    return outputs, time.perf_counter() - start


@dataclass
class Run:
    """One decoder's answer to one question."""

    tokens: int
    seconds: float
    passes: int | None = None
    """Verification passes (mtp and the --against drafters; None for `generate`)."""
    matches_plain: bool | None = None
    """Whether its tokens equal plain `generate`'s (greedy mtp and --against drafters; None otherwise)."""


@dataclass
class Answered:
    """Every decoder's answer to one question, and what mtp's verification accepted."""

    category: str
    runs: dict[str, Run]
    """By decoder: those of METHODS that ran, in that order, then the --against ones (`against_1`, ...)."""
    acceptance: Acceptance = field(default_factory=Acceptance)


@dataclass
class Summary:
    """Totals over questions: each decoder's tokens/s counts its own tokens; mismatches count the questions where a
    decoder's output differs from plain `generate`'s (greedy only; None when sampling)."""

    questions: int
    tokens_per_second: dict[str, float]
    speedup: dict[str, float]
    """mtp's tokens/s over each other decoder's, and over the fastest plain one's (`fastest_plain`)."""
    tau: dict[str, float]
    """Tokens per verification pass of mtp and of each --against drafter."""
    mismatches: dict[str, int | None]
    acceptance: dict
    """mtp's `Acceptance.report()`."""


def result_run(result: GenerationResult, plain: list[int] | None) -> Run:
    """A decoder's run from its `GenerationResult`, compared with plain `generate`'s tokens when greedy."""
    matches = None if plain is None else result.token_ids == plain
    return Run(len(result.token_ids), result.seconds, result.forward_passes, matches)


def summarise(answers: list[Answered]) -> Summary:
    names = list(answers[0].runs)
    speed = {
        name: sum(a.runs[name].tokens for a in answers) / sum(a.runs[name].seconds for a in answers) for name in names
    }
    checked = [name for name in names if answers[0].runs[name].passes is not None]  # mtp and the --against ones
    tau = {
        name: sum(a.runs[name].tokens for a in answers) / max(sum(a.runs[name].passes for a in answers), 1)
        for name in checked
    }
    mismatches = {
        name: None
        if answers[0].runs[name].matches_plain is None
        else sum(not a.runs[name].matches_plain for a in answers)
        for name in checked
    }
    speedup = {"fastest_plain": speed["mtp"] / max(speed[name] for name in PLAIN if name in speed)}
    speedup |= {name: speed["mtp"] / value for name, value in speed.items() if name != "mtp"}
    acceptance = sum((a.acceptance for a in answers), Acceptance())
    return Summary(len(answers), speed, speedup, tau, mismatches, acceptance.report())


def table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table, the first column left-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    return "\n".join([*lines, *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)])


def markdown(summary: dict[str, Summary]) -> str:
    overall = summary["overall"]
    others = [name for name in overall.tokens_per_second if name != "mtp"]  # in the runs' order
    drafters = [name for name in others if name.startswith("against_")]
    ratios = (["fastest_plain"] if len(set(PLAIN) & set(others)) > 1 else []) + others  # vs the fastest plain first
    columns = ["category", "questions", "tau", *(f"{name.replace('_', ' ')} tok/s" for name in ["mtp", *others])]
    columns += [*(f"vs {name.replace('_', ' ')}" for name in ratios), "accepted from heads / lookup", "mismatches"]
    columns += [f"{name.replace('_', ' ')} {figure}" for name in drafters for figure in ("tau", "mismatches")]

    def shown(mismatches: int | None):
        return "n/a (sampling)" if mismatches is None else mismatches

    rows = []
    for name, s in summary.items():
        lookup = s.acceptance["by_source"].get("lookup", 0)
        cells = [name, s.questions, f"{s.tau['mtp']:.2f}"]
        cells += [f"{s.tokens_per_second[method]:.1f}" for method in ["mtp", *others]]
        cells += [f"{s.speedup[method]:.2f}x" for method in ratios]
        cells += [f"{s.acceptance['accepted'] - lookup} / {lookup}", shown(s.mismatches["mtp"])]
        cells += [figure for d in drafters for figure in (f"{s.tau[d]:.2f}", shown(s.mismatches[d]))]
        rows.append(cells)
    slower = [name for name, s in summary.items() if s.speedup["fastest_plain"] < 1]
    return table(columns, rows) + (
        f"\n\nSlower than the fastest plain decoder here: {', '.join(slower)}." if slower else ""
    )


def acceptance_line(acceptance: dict) -> str:
    """`Acceptance.report()` in one line: the share of passes that accepted a candidate at each depth, and the
    accepted candidates by the drafter that proposed them."""
    depths = ", ".join(f"{d} {rate:.0%}" for d, rate in enumerate(acceptance["rate_at_depth"], 1))
    if not depths:
        return f"mtp's {acceptance['passes']} passes accepted no candidate"
    sources = ", ".join(f"{name} {count}" for name, count in acceptance["by_source"].items())
    return (
        f"mtp's {acceptance['passes']} passes accepted a candidate at depth {depths}; "
        f"accepted candidates by drafter: {sources}"
    )


@dataclass
class BatchRun:
    """Plain `generate` and mtp answering the questions B at a time, against one at a time."""

    batch_size: int
    tokens_per_second: dict[str, float]
    """`plain` (batched), `mtp` (batched) and `mtp_alone` (one at a time)."""
    speedup_vs_plain: float
    speedup_vs_mtp_alone: float
    tau: float
    mismatches_vs_alone: int | None
    """mtp's outputs unlike each prompt decoded alone by plain `generate` (greedy only)."""
    mismatches_vs_plain_batched: int | None
    plain_batched_mismatches_vs_alone: int | None


def bench_batches(
    decoder: Decoder, chats: list, sizes: list[int], max_new_tokens: int, sampling: Sampling
) -> list[BatchRun]:
    """Per batch size B: total tokens/s of plain `generate` and of mtp, B prompts at a time, against one at a time;
    tau (each row's tokens per verification pass, over all rows); when greedy, how many outputs differ: mtp's
    from each prompt decoded alone by plain `generate` and from plain batched `generate`, and plain batched
    `generate`'s own from alone. Plain and mtp one at a time run first, then each size's two in turn. Plain
    `generate` of B rows is the faster of its usual products and mtp's (`mtp.linears`), when those differ for B."""
    model = decoder.base_model
    prompts = [decoder.encode(messages).to(model.device) for messages in chats]

    def fastest_plain(size: int) -> tuple[list[list[int]], float]:
        with usual_linears(model):
            found = timed_generate(model, prompts, max_new_tokens, sampling, size)
        if size in narrow_counts(model):
            found = min(found, timed_generate(model, prompts, max_new_tokens, sampling, size), key=lambda f: f[1])
        return found

    def ours(size: int) -> tuple[list[GenerationResult], float]:
        start = time.perf_counter()
        results = decoder.generate(chats, max_new_tokens, sampling=sampling, batch_size=size)
        return results, time.perf_counter() - start

    def differ(outputs: list[list[int]], others: list[list[int]]) -> int | None:
        return sum(a != b for a, b in zip(outputs, others, strict=True)) if sampling.greedy else None

    (plain_alone, plain_alone_seconds), (alone, alone_seconds) = fastest_plain(1), ours(1)
    runs = []
    for size in tqdm(sizes, desc="batch sizes"):
        plain, plain_seconds = fastest_plain(size) if size > 1 else (plain_alone, plain_alone_seconds)
        results, seconds = ours(size) if size > 1 else (alone, alone_seconds)
        tokens = [result.token_ids for result in results]
        speed = {
            "plain": sum(map(len, plain)) / plain_seconds,
            "mtp": sum(map(len, tokens)) / seconds,
            "mtp_alone": sum(len(r.token_ids) for r in alone) / alone_seconds,
        }
        tau = sum(map(len, tokens)) / max(sum(result.forward_passes for result in results), 1)
        ratios = speed["mtp"] / speed["plain"], speed["mtp"] / speed["mtp_alone"]
        mismatches = differ(tokens, plain_alone), differ(tokens, plain), differ(plain, plain_alone)
        runs.append(BatchRun(size, speed, *ratios, tau, *mismatches))
    return runs


def batch_markdown(runs: list[BatchRun], questions: int) -> str:
    columns = [
        "B",
        "plain batched tok/s",
        "mtp batched tok/s",
        "mtp one at a time tok/s",
        "vs plain batched",
        "vs mtp one at a time",
        "tau",
        f"mtp outputs unlike alone / unlike plain batched (of {questions})",
        "plain batched unlike alone",
    ]
    rows = [
        [
            r.batch_size,
            *(f"{r.tokens_per_second[name]:.1f}" for name in ("plain", "mtp", "mtp_alone")),
            f"{r.speedup_vs_plain:.2f}x",
            f"{r.speedup_vs_mtp_alone:.2f}x",
            f"{r.tau:.2f}",
            f"{r.mismatches_vs_alone} / {r.mismatches_vs_plain_batched}",
            r.plain_batched_mismatches_vs_alone,
        ]
        for r in runs
    ]
    return table(columns, rows).replace("| --- |", "| ---: |", 1)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True)
    parser.add_argument(
        "--against",
        metavar="HEADS",
        action="append",
        default=[],
        help="also decode with this drafter folder (for the same base, with its own saved tree "
        "and lookup), interleaved in the same run; repeat it for more (against 1, 2, ...)",
    )
    parser.add_argument(
        "--against-tree",
        metavar="TREE",
        action="append",
        default=[],
        help="the --against drafters' trees instead of their saved ones (as --tree), one per "
        "--against in order; with one folder twice: two trees of one drafter side by side",
    )
    parser.add_argument("--questions", required=True, help="JSON lines with `turns` (first turn used) or `prompt`")
    parser.add_argument("--limit", type=int, help="the first N questions, spread over categories in file order")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", help=TREE_HELP)
    add_sampling_arguments(parser)
    add_lookup_arguments(parser)
    parser.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        metavar="B",
        help="instead: total tokens/s of mtp and plain `generate` answering B prompts at a time, "
        "for each B, against one at a time",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="time each decoder N times per question, in turn, and keep its fastest time (greedy "
        "only): steadier figures from few questions on a noisy machine",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        default=None,
        help="eager verification passes (see mtp.decoding.compiled), and no compiled plain decoder",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_weights_argument(parser)
    parser.add_argument(
        "--llama-cpp",
        metavar="FILE.gguf",
        help="time llama.cpp's plain decoding of this file too "
        "(the base's own: llama-cpp-python, pip install '.[peers]')",
    )
    parser.add_argument("--out", default="runs/bench/bench.json", help="JSON out; the Markdown table goes beside it")
    args = parser.parse_args()
    if args.against_tree and len(args.against_tree) != len(args.against):
        raise ValueError(
            f"--against-tree given {len(args.against_tree)} times for {len(args.against)} --against "
            "drafters: give one tree per --against, in the same order (a number N for the grown tree)."
        )
    if args.repeat < 1 or (args.repeat > 1 and (not sampling_from(args).greedy or args.batch_size)):
        raise ValueError(
            f"--repeat {args.repeat}: give 1 or more, and more than 1 only for greedy decoding of "
            "questions one at a time (samples differ from one time to the next)."
        )
    if args.batch_size and min(args.batch_size) < 1:
        raise ValueError(f"--batch-size {args.batch_size}: give batch sizes of 1 or more.")
    return args


def chosen_questions(path: str, limit: int | None) -> list[dict]:
    """The questions of `path`; with `limit`, the first ones round-robin over categories, so a small limit still
    covers them all."""
    questions = read_rows(path)
    if limit:
        by_category = defaultdict(list)
        for question in questions:
            by_category[question.get("category", "all")].append(question)
        questions = [q for group in zip(*by_category.values(), strict=False) for q in group][:limit]
    return questions


class Contest:
    """The decoders that answer each question in turn: plain `generate` (with the usual products, and with mtp's
    where they differ for one row), prompt lookup, mtp's compiled plain loop (when compiled), llama.cpp (with
    --llama-cpp), mtp with its heads alone (when its lookup is on), mtp, and the --against drafters."""

    def __init__(
        self,
        decoder: Decoder,
        others: list[Decoder],
        sampling: Sampling,
        max_new_tokens: int,
        plain_fast: bool,
        peer: "LlamaCpp | None" = None,
    ):
        self.decoder, self.others, self.sampling, self.max_new_tokens = decoder, others, sampling, max_new_tokens
        self.peer = peer
        self.model = decoder.base_model
        self.heads_alone = decoder.lookup and Decoder(
            self.model, decoder.tokenizer, decoder.drafter, decoder.tree, compiled=decoder.compiled
        )
        self.plain_compiled = decoder.compiled and Decoder(self.model, decoder.tokenizer, compiled=decoder.compiled)
        self.plain_fast = plain_fast  # else `generate` with mtp's products is `plain` itself

    def warm_up(self) -> None:
        hello = [{"role": "user", "content": "Hello"}]
        for each in (self.decoder, self.heads_alone, self.plain_compiled, *self.others):
            if each:
                each.generate(hello, max_new_tokens=8, sampling=self.sampling)
        prompt = [self.decoder.encode(hello).to(self.model.device)]
        if self.peer:
            self.peer.answer(prompt[0], 8, self.sampling, eos_ids(self.model))
        timed_generate(self.model, prompt, 8, self.sampling, prompt_lookup_num_tokens=10)
        timed_generate(self.model, prompt, 8, self.sampling)
        with usual_linears(self.model):
            timed_generate(self.model, prompt, 8, self.sampling)

    def answer(self, question: dict, messages: list[dict]) -> Answered:
        """Each decoder in turn, once."""
        input_ids = self.decoder.encode(messages).to(self.model.device)
        limit, sampling = self.max_new_tokens, self.sampling
        runs = {}
        with usual_linears(self.model):  # as users run it
            (plain,), seconds = timed_generate(self.model, [input_ids], limit, sampling)
        runs["plain"] = Run(len(plain), seconds)
        if self.plain_fast:
            (fast,), seconds = timed_generate(self.model, [input_ids], limit, sampling)
            runs["plain_fast"] = Run(len(fast), seconds)
        if self.plain_compiled:
            steps = self.plain_compiled.generate(messages, max_new_tokens=limit, sampling=sampling)
            runs["plain_compiled"] = Run(len(steps.token_ids), steps.seconds)
        if self.peer:
            runs["llama_cpp"] = self.peer.answer(input_ids, limit, sampling, eos_ids(self.model))
        (lookup,), seconds = timed_generate(self.model, [input_ids], limit, sampling, prompt_lookup_num_tokens=10)
        runs["lookup"] = Run(len(lookup), seconds)
        compared = plain if sampling.greedy else None  # samples differ by chance
        if self.heads_alone:
            alone = self.heads_alone.generate(messages, max_new_tokens=limit, sampling=sampling)
            runs["heads"] = Run(len(alone.token_ids), alone.seconds)
        result = self.decoder.generate(messages, max_new_tokens=limit, sampling=sampling)
        runs["mtp"] = result_run(result, compared)
        for number, other in enumerate(self.others, 1):
            runs[f"against_{number}"] = result_run(
                other.generate(messages, max_new_tokens=limit, sampling=sampling), compared
            )
        return Answered(question.get("category", "all"), runs, result.acceptance)


class LlamaCpp:
    """llama.cpp's plain decoding of a GGUF file, through llama-cpp-python (`pip install ".[peers]"`, built for the
    machine: docs/evaluation.md), on `threads` threads: greedy, or sampled with the same temperature, top-k and
    top-p (and no other sampler)."""

    def __init__(self, path: str, threads: int, context: int):
        try:
            from llama_cpp import Llama
        except ImportError as error:
            raise ModuleNotFoundError(
                "--llama-cpp needs llama-cpp-python: pip install '.[peers]' (built for this "
                "machine: docs/evaluation.md gives the command)"
            ) from error
        if not Path(path).is_file():
            raise FileNotFoundError(f"GGUF file {path!r} does not exist: give --llama-cpp the base's .gguf file.")
        self.llm = Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)

    def answer(self, input_ids: torch.Tensor, limit: int, sampling: Sampling, eos: set[int]) -> Run:
        """Its answer to the prompt `input_ids` (1, T) (mtp's tokens: the file's own vocabulary), from an empty
        cache: the new tokens before an EOS, at most `limit`, and the seconds they took with the prompt's."""
        settings = (
            dict(temp=0.0)
            if sampling.greedy
            else dict(temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)
        )
        tokens, start = [], time.perf_counter()
        self.llm.reset()  # (no prompt reused from the last answer)
        for token in self.llm.generate(input_ids[0].tolist(), min_p=0.0, repeat_penalty=1.0, **settings):
            if token in eos or len(tokens) == limit:
                break
            tokens.append(token)
        return Run(len(tokens), time.perf_counter() - start)


def fastest_times(answers: list[Answered]) -> Answered:
    """Repeated answers to one question (greedy: the same tokens every time), each decoder's fastest time kept."""
    first = answers[0]
    runs = {name: replace(run, seconds=min(a.runs[name].seconds for a in answers)) for name, run in first.runs.items()}
    return Answered(first.category, runs, first.acceptance)


@user_errors
def main() -> None:
    args = arguments()
    sampling = sampling_from(args)
    if args.seed is not None:
        torch.manual_seed(args.seed)  # plain generate and prompt lookup sample with torch's global generator
    dtype = getattr(torch, args.dtype)
    decoder = mtp.load(
        args.drafter,
        args.device,
        dtype,
        tree=args.tree,
        lookup=lookup_from(args),
        weights=args.weights,
        compile=False if args.batch_size else args.compile,
    )  # batches run eager passes
    trees = args.against_tree or [None] * len(args.against)
    others = [
        mtp.load(path, args.device, dtype, tree=tree, weights=args.weights)
        for path, tree in zip(args.against, trees, strict=True)
    ]
    questions = chosen_questions(args.questions, args.limit)
    chats = [[{"role": "user", "content": q["turns"][0] if "turns" in q else q["prompt"]}] for q in questions]
    for messages in chats:  # every question fits the context, before any runs
        decoder.check_length(decoder.encode(messages).shape[1], args.max_new_tokens)
    plan = ("paced per prompt, from " if len(decoder.pacer.options(1)) > 1 else "") + describe(decoder.pacer.best(1))
    print(f"mtp decodes with {plan}", file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {
        "plan": plan,
        "threads": torch.get_num_threads(),
        "device_name": device_name(args.device),
        "plain_fast": 1 in narrow_counts(decoder.base_model),
    }  # (mtp's products differ for one row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.batch_size:
        decoder.generate([{"role": "user", "content": "Hello"}], max_new_tokens=8, sampling=sampling)
        runs = bench_batches(decoder, chats, args.batch_size, args.max_new_tokens, sampling)
        written, text = {"batches": [asdict(run) for run in runs]}, batch_markdown(runs, len(chats))
    else:
        peer = args.llama_cpp and LlamaCpp(args.llama_cpp, torch.get_num_threads(), min(decoder.context or 4096, 4096))
        contest = Contest(decoder, others, sampling, args.max_new_tokens, settings["plain_fast"], peer)
        contest.warm_up()
        answers = [
            fastest_times([contest.answer(question, messages) for _ in range(args.repeat)])
            for question, messages in zip(tqdm(questions, desc="benchmark", unit="question"), chats, strict=True)
        ]
        categories = dict.fromkeys(answer.category for answer in answers)
        summary = {c: summarise([a for a in answers if a.category == c]) for c in categories}
        summary["overall"] = summarise(answers)
        written = {"summary": {name: asdict(s) for name, s in summary.items()}}
        written["questions"] = [asdict(answer) for answer in answers]
        text = markdown(summary) + "\n\n" + acceptance_line(summary["overall"].acceptance)
    out.write_text(json.dumps({"settings": settings} | written, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
