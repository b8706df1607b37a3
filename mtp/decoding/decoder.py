"""Decoding: propose a tree of candidates with the heads, verify it in one forward pass of the base model, accept
the longest prefix the base model itself would produce, append, stop? The steps of one prompt or of a batch are
`mtp.decoding.batch`'s; here are the prompts, their stop rules and their results."""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mtp.decoding.acceptance import Acceptance
from mtp.decoding.batch import Batch
from mtp.decoding.compiled import CompiledPass
from mtp.decoding.lookup import Lookup
from mtp.decoding.pacing import Pacer, Plan
from mtp.decoding.proposer import DrafterProtocol, LookupProposer
from mtp.decoding.sampling import GREEDY, Sampling
from mtp.decoding.target import Target
from mtp.decoding.tree import DynamicTree, Tree


@dataclass
class GenerationResult:
    """What one `generate` call produced.

    `tau` is new tokens per verification forward pass of the base model: len(token_ids) / forward_passes,
    where forward_passes counts the passes after the prefill (the prefill, which yields the first new token,
    is not counted). Plain one-token decoding has tau = n / (n - 1), a little above 1.
    """

    text: str = ""
    """The new text, cut before the caller's stop sequence if one ended generation."""
    token_ids: list[int] = field(default_factory=list)
    """The new tokens (no EOS), as few as cover `text`: they decode to `text`, but where a stop sequence begins
    inside a token, that token is kept whole and they decode to `text` and the token's rest."""
    finish_reason: str = "length"
    """`stop` (an EOS token or a stop sequence) or `length` (max_new_tokens reached)."""
    stop_sequence: str | None = None
    """The caller's stop sequence that ended generation, if one did."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """What each verification pass accepted: tokens per pass, candidates by the drafter that proposed them."""
    seconds: float = 0.0

    @property
    def forward_passes(self) -> int:
        return self.acceptance.passes

    @property
    def tau(self) -> float:
        return len(self.token_ids) / max(self.forward_passes, 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0


class Decoder:
    """Decoding of `base_model` with a `drafter` proposing a `tree` of candidates each step: greedy output equal
    token for token to the base model's, or sampling with the base model's distribution (see `mtp.decoding.sampling`).

    With `lookup`, prompt lookup's candidates join the tree each step (see `mtp.decoding.lookup`). Without heads or
    lookup, every step verifies the root alone: plain one-token decoding through the same loop. A `pacer` instead
    chooses each step's tree and lookup by expected speed (`mtp.decoding.pacing`; `mtp.load` fits one to the machine).
    With `compiled` (of this base model), a lone prompt's passes run compiled (`mtp.decoding.compiled`).
    """

    def __init__(
        self,
        base_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafter: DrafterProtocol | None = None,
        tree: Tree | DynamicTree | None = None,
        lookup: Lookup | None = None,
        pacer: Pacer | None = None,
        compiled: CompiledPass | None = None,
    ):
        self.target = compiled.target if compiled is not None else Target(base_model)
        self.compiled = compiled
        self.base_model, self.tokenizer, self.drafter = base_model, tokenizer, drafter
        if pacer is None:
            tree = tree if drafter is not None and tree is not None else Tree.from_paths([])
            levels = tree.deepest if isinstance(tree, DynamicTree) else tree.depth
            if levels and drafter.max_depth is not None and levels > drafter.max_depth:
                depth = drafter.max_depth
                raise ValueError(
                    f"The tree is {levels} levels deep, but the drafter fills only {depth} levels: "
                    f"give a tree at most {depth} deep."
                )
            pacer = Pacer.fixed(Plan(tree, lookup if lookup is not None and lookup.reach else None))
        self.pacer = pacer
        plan = pacer.best(1)  # what a step over one prompt verifies at first
        self.tree, self.lookup = plan.tree, plan.lookup
        self.eos_ids, self.context = self.target.eos_ids, self.target.context
        self._trees = {}  # each plan's tree cut at each depth, on the model's device, for every batch

    def batch(self, sampling: Sampling = GREEDY) -> Batch:
        """An empty batch of rows to decode with this decoder's drafters (see `mtp.decoding.batch`)."""
        proposers = [self.drafter.proposer(self.target, self._trees)] if self.drafter is not None else []
        if any(plan.lookup for options in self.pacer.plans.values() for plan, _ in options):
            proposers.append(LookupProposer())
        return Batch(self.target, proposers, self.pacer, sampling, self.compiled)

    def encode(self, prompt: str | list[dict]) -> torch.Tensor:
        """Prompt ids (1, T): chat messages go through the chat template, a string is taken as it is."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        else:
            ids = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "") if prompt else ""
        if ids.shape[1] == 0 or not isinstance(text, str) or not text.strip():
            raise ValueError("The prompt is empty: give some text, or end the messages with a non-empty one.")
        if self.context is not None and ids.shape[1] >= self.context:
            raise ValueError(
                f"The prompt has {ids.shape[1]} tokens, but the model's context window is {self.context}: shorten it."
            )
        return ids

    def check_length(self, prompt_len: int, max_new_tokens: int) -> int:
        """prompt_len + max_new_tokens, once checked: max_new_tokens >= 0, and the sum within the context window
        (and within a longrope model's original length)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens}: use 0 or a positive number of tokens.")
        max_length = prompt_len + max_new_tokens
        if self.context is not None and max_length > self.context:
            raise ValueError(
                f"The prompt has {prompt_len} tokens and max_new_tokens is {max_new_tokens}: {max_length} in all, "
                f"past the model's context window of {self.context} tokens: lower max_new_tokens to at most "
                f"{self.context - prompt_len} or shorten the prompt."
            )
        limit = self.target.rope_limit
        if limit is not None and max_length > limit:
            raise ValueError(
                f"The prompt has {prompt_len} tokens and max_new_tokens is {max_new_tokens}: {max_length} in all, "
                f"past {limit}, where {self.base_model.config.model_type}'s longrope RoPE switches every position "
                f"to its long factors (plain decoding then recomputes the whole sequence, which tree decoding cannot "
                f"match): keep the prompt and max_new_tokens within {limit} tokens (max_new_tokens at most "
                f"{max(limit - prompt_len, 0)}), or decode this request with the model's own `generate`."
            )
        return max_length

    def generate(
        self,
        prompt: str | list[dict] | list[str | list[dict]],
        max_new_tokens: int = 128,
        stop: list[str] = (),
        sampling: Sampling = GREEDY,
        batch_size: int = 1,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate: greedily (token for token what the base model alone would generate), or by `sampling`.

        Args:
            prompt: chat messages (put through the chat template) or text (tokenized as it is); or a list of such
                prompts, answered `batch_size` at a time, for a list of results in the same order.
            max_new_tokens: at most this many new tokens, exactly this many unless generation stops first; the
                prompt and max_new_tokens together must fit the model's context window (else a ValueError says
                by how much), as a server refuses a request that cannot fit.
            stop: stop sequences, matched on the decoded text; the result ends before the first one found.
            sampling: temperature, top-k, top-p, seed and acceptance rule; default greedy.
            batch_size: how many prompts of a list are decoded together, in one verification pass per step; a
                finished one leaves the batch at once and the next waiting prompt takes its place. Greedy rows
                equal each prompt decoded alone up to floating-point rounding (a batched pass multiplies other
                shapes, so a near tie could flip). Sampled rows follow each prompt's distribution, prompt i
                drawing from its own generator (seeded from the sampling seed and i): its draws do not depend on the
                other prompts.
        """
        many = _is_list_of_prompts(prompt)
        prompts = prompt if many else [prompt]
        results = [GenerationResult() for _ in prompts]
        for _ in self._answers(prompts, max_new_tokens, stop, sampling, batch_size, results):
            pass
        return results if many else results[0]

    def answers(
        self,
        prompts: list,
        max_new_tokens: int = 128,
        sampling: Sampling = GREEDY,
        batch_size: int = 1,
        numbers: list[int] | None = None,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """`generate` of the list `prompts`, yielding (its place in `prompts`, its result) as each answer ends, in
        the order they end: a caller keeps each as it comes (self-distillation writes it to disk). `numbers`:
        each prompt's number (default its place), which seeds its generator when sampling (with the seed)."""
        results = [GenerationResult() for _ in prompts]
        for index, _, done in self._answers(prompts, max_new_tokens, (), sampling, batch_size, results, numbers):
            if done:
                yield index, results[index]

    def stream(
        self,
        prompt: str | list[dict],
        max_new_tokens: int = 128,
        stop: list[str] = (),
        result: GenerationResult = None,
        sampling: Sampling = GREEDY,
    ) -> Iterator[str]:
        """`generate` of one prompt, yielding the text as it is settled and never any text past a stop sequence;
        pass a `GenerationResult()` as `result` to get the figures once the stream ends."""
        results = [GenerationResult() if result is None else result]
        for _, text, _ in self._answers([prompt], max_new_tokens, stop, sampling, 1, results):
            if text:
                yield text

    def _answers(
        self,
        prompts: list,
        max_new_tokens: int,
        stop: list[str],
        sampling: Sampling,
        batch_size: int,
        results: list[GenerationResult],
        numbers: list[int] | None = None,
    ) -> Iterator[tuple[int, str, bool]]:
        """Decode `prompts`, at most `batch_size` at a time, filling `results` (prompt i sampling with a generator
        seeded from the seed and `numbers[i]`, default i); yield (prompt index, new text, whether its answer is
        done) as text settles and as each answer ends."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: decode at least 1 prompt at a time.")
        encoded, max_lengths = [], []
        for i, prompt in enumerate(prompts):  # every prompt checked before any work
            try:
                encoded.append(self.encode(prompt))
                max_lengths.append(self.check_length(encoded[-1].shape[1], max_new_tokens))
            except ValueError as error:
                raise ValueError(f"Prompt {i + 1} of {len(prompts)}: {error}" if len(prompts) > 1 else error) from None
        if max_new_tokens == 0:
            return
        self.pacer.prepare(min(batch_size, len(prompts)))
        stop = [s for s in stop if s]
        batch, answers, waiting = self.batch(sampling), [], list(range(len(prompts)))[::-1]
        try:
            while waiting or answers:
                if waiting and len(answers) < batch_size:  # a prompt joins: its prefill settles its first token
                    i = waiting.pop()
                    answers.append(_Answer(i, results[i], max_new_tokens, stop, time.perf_counter()))
                    number = i if numbers is None else numbers[i]
                    passes = [(answers[-1], ([batch.add(encoded[i], max_lengths[i], number)], {}), False)]
                else:
                    passes = [(answer, settled, True) for answer, settled in zip(answers, batch.step(), strict=True)]
                for answer, (settled, accepted_by), verified in passes:
                    text = answer.take(self.tokenizer, self.eos_ids, settled, accepted_by, verified)
                    if text or answer.done:
                        yield answer.index, text, answer.done
                batch.keep([not answer.done for answer in answers])
                answers = [answer for answer in answers if not answer.done]
        finally:  # ended, or interrupted (an exception, a stream left unfinished): the static cache freed
            batch.release()


@dataclass
class _Answer:
    """One prompt's output as passes settle its tokens: the stop rules, and how much of the text is shown."""

    index: int
    result: GenerationResult
    max_new_tokens: int
    stop: list[str]
    start: float
    """When the prompt joined the batch: its result's `seconds` count from here."""
    shown: int = 0
    done: bool = False

    def take(self, tokenizer, eos_ids: set[int], settled: list[int], accepted_by: dict, verified: bool) -> str:
        """Add the tokens a pass settled (a verification pass, or the prefill); return the text now safe to show."""
        result = self.result
        if verified:
            result.acceptance.add(len(settled), accepted_by)
        for token in settled:
            if token in eos_ids:
                result.finish_reason = "stop"
                break
            result.token_ids.append(token)
            if len(result.token_ids) == self.max_new_tokens:
                break
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        found = [(text.find(s), s) for s in self.stop if s in text]
        if found:  # the earliest stop sequence ends the text; keep the fewest tokens that cover it
            cut, result.stop_sequence = min(found)
            result.finish_reason, text = "stop", text[:cut]
            while result.token_ids and len(tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)) >= cut:
                result.token_ids.pop()
        result.text, result.seconds = text, time.perf_counter() - self.start
        self.done = result.finish_reason == "stop" or len(result.token_ids) == self.max_new_tokens
        visible = len(text) if self.done else _holdback(text, self.stop)
        new, self.shown = text[self.shown : visible], max(self.shown, visible)
        return new


def _is_list_of_prompts(prompt) -> bool:
    """A list of prompts (strings, or lists of chat messages), not one prompt given as chat messages."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], dict)


def _holdback(text: str, stop: list[str]) -> int:
    """How much of `text` is safe to show: not an unfinished character, nor a possible start of a stop sequence."""
    safe = len(text.rstrip("\ufffd"))
    for s in stop:
        for size in range(min(len(s) - 1, safe), 0, -1):
            if text[:safe].endswith(s[:size]):
                safe -= size
                break
    return safe
