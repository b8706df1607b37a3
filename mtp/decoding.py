"""The decoding loop: propose a tree of candidates with the heads, verify it in one forward pass of the base
model, accept the longest prefix the base model itself would produce, append, stop?"""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from mtp.cache import attention_windows, keep_accepted, tree_attention_mask
from mtp.heads import Heads
from mtp.lookup import Lookup
from mtp.sampling import GREEDY, Sampling, accept_exact, accept_typical, draw
from mtp.tree import LOOKUP, Tree


@dataclass
class GenerationResult:
    """What one `generate` call produced.

    `tau` is new tokens per verification forward pass of the base model: len(token_ids) / forward_passes,
    where forward_passes counts the passes after the prefill (the prefill, which yields the first new token,
    is not counted). Plain one-token decoding has tau = n / (n - 1), a little above 1.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    """`stop` (an EOS token or a stop sequence) or `length` (max_new_tokens reached)."""
    stop_sequence: str | None = None
    """The caller's stop sequence that ended generation, if one did."""
    forward_passes: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    """Tokens accepted per verification pass, the bonus token included."""
    lookup_accepted: int = 0
    """Accepted candidates that prompt lookup proposed and no head did (the rest of the candidates are the heads')."""
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return len(self.token_ids) / max(self.forward_passes, 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0


class Decoder:
    """Decoding of `base_model` with `heads` proposing a `tree` of candidates each step: greedy output equal
    token for token to the base model's, or sampling with the base model's distribution (see `mtp.sampling`).

    With `lookup`, prompt lookup's candidates join the tree each step (see `mtp.lookup`). Without heads or
    lookup, every step verifies the root alone: plain one-token decoding through the same loop.
    """

    def __init__(
        self,
        base_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        heads: Heads | None = None,
        tree: Tree | None = None,
        lookup: Lookup | None = None,
    ):
        if base_model.config._attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"Attention implementation {base_model.config._attn_implementation!r} of "
                f"{base_model.config.model_type} takes no custom 4D tree mask: load it with attn_implementation='sdpa'."
            )
        self.base_model, self.tokenizer, self.heads = base_model, tokenizer, heads
        self.lookup = lookup if lookup is not None and lookup.reach else None
        self.tree = tree if heads is not None and tree is not None else Tree.from_paths([])
        if heads is not None and self.tree.size > 1:
            Tree.from_paths(self.tree.paths, num_heads=heads.config.num_heads)  # check the depth fits the heads
        eos = base_model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.top_k = int(self.tree.ranks.max()) + 1 if self.tree.size > 1 else 1
        self.lm_head, self.embed = base_model.get_output_embeddings(), base_model.get_input_embeddings()
        self.depth = int(self.tree.depths.max())
        self.windows = attention_windows(base_model.config)
        self.context = getattr(base_model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.softcap = getattr(base_model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        self._trees: dict[int, Tree] = {}  # the tree cut at each depth, on the model's device

    def encode(self, prompt: str | list[dict]) -> torch.Tensor:
        """Prompt ids (1, T): chat messages go through the chat template, a string is taken as it is."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        else:
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"]  # fmt: skip
        text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "") if prompt else ""
        if ids.shape[1] == 0 or not isinstance(text, str) or not text.strip():
            raise ValueError("The prompt is empty: give some text, or end the messages with a non-empty one.")
        if self.context is not None and ids.shape[1] >= self.context:
            raise ValueError(
                f"The prompt has {ids.shape[1]} tokens, but the model's context window is {self.context}: shorten it."
            )
        return ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's next-token logits (..., V) from its last hidden states (..., H)."""
        logits = self.lm_head(hidden)
        if self.softcap:  # Gemma-2's final soft cap, as the model's own forward applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _tree_within(self, depth: int) -> Tree:
        """The tree without nodes deeper than `depth` (at most the tree's own depth), on the model's device (built
        once per depth)."""
        if depth not in self._trees:
            self._trees[depth] = self.tree.within(depth).to(self.base_model.device)
        return self._trees[depth]

    def check_length(self, prompt_len: int, max_new_tokens: int) -> int:
        """prompt_len + max_new_tokens, once checked: max_new_tokens >= 0, and the sum within the context window."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens}: use 0 or a positive number of tokens.")
        max_length = prompt_len + max_new_tokens
        if self.context is not None and max_length > self.context:
            raise ValueError(
                f"The prompt has {prompt_len} tokens and max_new_tokens is {max_new_tokens}: {max_length} in all, "
                f"past the model's context window of {self.context} tokens: lower max_new_tokens to at most "
                f"{self.context - prompt_len} or shorten the prompt."
            )
        return max_length

    @torch.no_grad()
    def steps(
        self, input_ids: torch.Tensor, sampling: Sampling = GREEDY, max_length: int | None = None
    ) -> Iterator[tuple[list[int], int]]:
        """Yield the tokens each pass settles (the prefill's first token, then per step the accepted candidates
        and the bonus token) and how many of them prompt lookup alone proposed. Runs until the caller stops.

        Args:
            input_ids: (1, T) the prompt.
            sampling: greedy, or how to sample.
            max_length: the sequence ends at this length (prompt and new tokens; default: the model's context
                window), so no tree node is placed at position max_length - 1 or later: a token there would be
                past the end, and the last token's own guess would only repeat the bonus token of its parent.
        """
        generator = sampling.generator()
        device = self.base_model.device
        max_length = max_length or self.context or float("inf")
        backbone = self.base_model.get_decoder()
        cache = DynamicCache()  # every position on every layer: see mtp.cache
        hidden = backbone(input_ids=input_ids.to(device), cache=cache, use_cache=True).last_hidden_state
        prefix_len = input_ids.shape[1]
        logits = self.logits(hidden[0, -1])  # (V,)
        root = int(logits.argmax()) if sampling.greedy else draw(sampling.probabilities(logits).cpu(), generator)
        last_hidden = hidden[0, -1]  # (H,) the last accepted position's hidden state
        sequence = torch.cat([input_ids[0].cpu(), torch.tensor([root])]) if self.lookup is not None else None
        yield [root], 0
        while True:
            with record_function("mtp.candidates"):  # the heads' guesses laid out on the tree
                depth = min(max_length - 2 - prefix_len, self.depth)  # the root sits at prefix_len
                tree = self._tree_within(depth)  # every prefix of a path is a path: the cut tree is `depth` deep
                tokens = torch.tensor([root], device=device)  # (1,) root only
                if tree.size > 1:  # (N+1,) the root and the heads' guesses
                    tokens = self.heads.tree_tokens(last_hidden, tokens, tree, self.lm_head, self.embed, self.top_k)
                if self.lookup is not None:  # node d sits at position prefix_len + d
                    room = max(max_length - 2 - prefix_len, 0)
                    tree, tokens = tree.graft(tokens, self.lookup.propose(sequence)[:room])
                mask = tree_attention_mask(tree.mask, tree.depths, prefix_len, self.windows, hidden.dtype)
            with record_function("mtp.verify"):  # one forward pass of the base model over the whole tree
                hidden = backbone(
                    input_ids=tokens[None],
                    position_ids=(prefix_len + tree.depths)[None],  # a node sits at its depth past the root
                    attention_mask=mask,
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state[0]  # (N+1, H)
            with record_function("mtp.accept"):
                logits = self.logits(hidden)  # (N+1, V) the base model's next-token logits after each node
                if sampling.greedy:
                    nodes, root = self._accept_greedy(tokens, logits.argmax(-1), tree.retrieve)
                elif sampling.acceptance == "exact":
                    nodes, root = accept_exact(tokens.cpu(), tree.children, logits, sampling, generator)
                else:
                    nodes, root = accept_typical(tokens, tree.retrieve, logits, sampling, generator)
                nodes = torch.as_tensor(nodes, device=device)  # (A+1,) root and accepted candidates
            with record_function("mtp.cache"):
                keep_accepted(cache, prefix_len, nodes)
            prefix_len += len(nodes)
            last_hidden = hidden[nodes[-1]]
            settled = tokens[nodes[1:]].tolist() + [root]
            if self.lookup is None:
                yield settled, 0
                continue
            sequence = torch.cat([sequence, torch.tensor(settled)])
            yield settled, int((tree.ranks[nodes] == LOOKUP).sum())

    @staticmethod
    def _accept_greedy(
        tokens: torch.Tensor, predictions: torch.Tensor, paths: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Along each root-to-leaf path, node d+1 is right iff its token is the base model's prediction at node
        d; the path with the most leading right nodes wins, and the prediction after its last is the bonus."""
        children = paths[:, 1:]  # (L, D)
        right = (children >= 0) & (tokens[children.clamp(min=0)] == predictions[paths[:, :-1].clamp(min=0)])
        accepted = right.int().cumprod(1).sum(1)  # (L,)
        best = int(accepted.argmax())
        nodes = paths[best, : int(accepted[best]) + 1]  # (A+1,)
        return nodes, int(predictions[nodes[-1]])

    def generate(
        self, prompt: str | list[dict], max_new_tokens: int = 128, stop: list[str] = (), sampling: Sampling = GREEDY
    ) -> GenerationResult:
        """Generate: greedily (token for token what the base model alone would generate), or by `sampling`.

        Args:
            prompt: chat messages (put through the chat template) or text (tokenized as it is).
            max_new_tokens: at most this many new tokens, exactly this many unless generation stops first; the
                prompt and max_new_tokens together must fit the model's context window (else a ValueError says
                by how much), as a server refuses a request that cannot fit.
            stop: stop sequences, matched on the decoded text; the result ends before the first one found.
            sampling: temperature, top-k, top-p, seed and acceptance rule; default greedy.
        """
        result = GenerationResult()
        for _ in self.stream(prompt, max_new_tokens, stop, result, sampling):
            pass
        return result

    def stream(
        self,
        prompt: str | list[dict],
        max_new_tokens: int = 128,
        stop: list[str] = (),
        result: GenerationResult = None,
        sampling: Sampling = GREEDY,
    ) -> Iterator[str]:
        """`generate`, yielding the text as it is settled and never any text past a stop sequence; pass a
        `GenerationResult()` as `result` to get the figures once the stream ends."""
        result = GenerationResult() if result is None else result
        start = time.perf_counter()
        stop = [s for s in stop if s]
        input_ids = self.encode(prompt)
        max_length = self.check_length(input_ids.shape[1], max_new_tokens)
        shown = 0  # characters of text already yielded
        if max_new_tokens == 0:
            return
        for passes, (settled, from_lookup) in enumerate(self.steps(input_ids, sampling, max_length)):
            if passes:  # the prefill is not a verification pass
                result.forward_passes += 1
                result.accept_lengths.append(len(settled))
                result.lookup_accepted += from_lookup
            for token in settled:
                if token in self.eos_ids:
                    result.finish_reason = "stop"
                    break
                result.token_ids.append(token)
                if len(result.token_ids) == max_new_tokens:
                    break
            text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            found = [(text.find(s), s) for s in stop if s in text]
            if found:  # the earliest stop sequence ends the text; keep the tokens wholly before it
                cut, result.stop_sequence = min(found)
                result.finish_reason, text = "stop", text[:cut]
                while len(self.tokenizer.decode(result.token_ids, skip_special_tokens=True)) > cut:
                    result.token_ids.pop()
            result.text, result.seconds = text, time.perf_counter() - start
            done = result.finish_reason == "stop" or len(result.token_ids) == max_new_tokens
            visible = len(text) if done else _holdback(text, stop)
            if visible > shown:
                yield text[shown:visible]
                shown = visible
            if done:
                return


def _holdback(text: str, stop: list[str]) -> int:
    """How much of `text` is safe to show: not an unfinished character, nor a possible start of a stop sequence."""
    safe = len(text.rstrip("\ufffd"))
    for s in stop:
        for size in range(min(len(s) - 1, safe), 0, -1):
            if text[:safe].endswith(s[:size]):
                safe -= size
                break
    return safe
