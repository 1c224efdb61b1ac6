"""What ``leapdecode bench`` sends each engine: a prompt set's independent prompts, or agent sessions
(``--prompts agent_loop``) whose every request carries the whole session so far, the engine's own answers
included, as an agent's client sends it.

A workload is requests ``0 .. n - 1`` in *waves*: the requests of a wave may be in flight together, and a wave
starts when the one before it has finished (a prompt set is one wave; an agent session's turn ``t`` cannot be
sent before its answer to turn ``t - 1`` exists). Each pass of one engine over the workload is a :class:`Run`,
which keeps the answers it got, so two engines whose answers differ (another precision, a lossy method) each go
on with their own conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leapdecode.bench.rows import Row, paired_ratio
from leapdecode.eval.prompts import AGENT_LOOP, AgentSession, agent_sessions, load_prompt_set
from leapdecode.llm import LLM


@dataclass
class Run:
    """One engine's pass over a workload: the text of every answer it got, by request."""

    answers: dict[int, str] = field(default_factory=dict)


class Workload:
    """Independent prompts, already token ids: one wave."""

    def __init__(self, prompts_ids: list[list[int]]) -> None:
        if not prompts_ids:
            raise ValueError("the workload has no requests (--num-prompts must be >= 1)")
        self._ids = prompts_ids
        self.waves: list[list[int]] = [list(range(len(prompts_ids)))]

    @property
    def num_requests(self) -> int:
        return sum(len(w) for w in self.waves)

    @property
    def batch(self) -> int:
        """The most requests in flight at once when every wave is submitted whole."""
        return max(len(w) for w in self.waves)

    def prompt_ids(self, run: Run, i: int) -> list[int]:
        """Request ``i``'s prompt in ``run`` (for a session: after ``run``'s answers to its earlier turns)."""
        return self._ids[i]

    def record(self, run: Run, i: int, text: str) -> None:
        run.answers[i] = text

    def first_prompt(self) -> list[int]:
        """Request 0's prompt, which no answer precedes (warm-ups)."""
        return self.prompt_ids(Run(), 0)


class AgentLoop(Workload):
    """Agent sessions: request ``(s, t)`` is session ``s``'s system prompt and turns ``0 .. t`` with the run's
    answers to turns ``0 .. t - 1`` between them. Requests are numbered session by session (a batch-1 run goes
    through one agent's session, then the next one's); wave ``t`` is every session's turn ``t``."""

    def __init__(self, llm: LLM, sessions: list[AgentSession], raw: bool, max_prompt_tokens: int | None) -> None:
        self.llm, self.sessions, self.raw, self.max_prompt_tokens = llm, sessions, raw, max_prompt_tokens
        self.where: list[tuple[int, int]] = [(s, t) for s, sess in enumerate(sessions) for t in range(len(sess.turns))]
        if not self.where:
            raise ValueError("the workload has no requests (--num-prompts must be >= 1)")
        index = {st: i for i, st in enumerate(self.where)}
        depth = max(len(s.turns) for s in sessions)
        self.index = index
        self.waves = [[index[(s, t)] for s in range(len(sessions)) if (s, t) in index] for t in range(depth)]

    def prompt_ids(self, run: Run, i: int) -> list[int]:
        s, t = self.where[i]
        sess = self.sessions[s]
        messages = [{"role": "system", "content": sess.system}]
        for k in range(t):
            answer = run.answers.get(self.index[(s, k)])
            if answer is None:
                raise RuntimeError(f"agent session {s + 1}: turn {t + 1} was sent before the answer to turn {k + 1}")
            messages += [{"role": "user", "content": sess.turns[k]}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": sess.turns[t]})
        if self.raw:  # a model with no chat template: the conversation as plain text, each part after a blank line
            ids = self.llm.get_tokenizer().encode("\n\n".join(m["content"] for m in messages) + "\n\n")
        else:
            ids = self.llm.apply_chat_template(messages)
        if self.max_prompt_tokens:
            return ids[-self.max_prompt_tokens:]
        context = self.llm.engine.max_model_len
        if len(ids) >= context:
            raise ValueError(f"agent session {s + 1}, turn {t + 1}: the session has grown to {len(ids)} tokens, "
                             f"past the model's context of {context}: lower --max-tokens, or pass --max-prompt-tokens "
                             "N to keep the last N tokens of each request")
        return ids


def _ratio_over(row: Row, base: Row, requests: list[int]) -> float:
    """``row``'s paired speed over ``base``'s on the given batch-1 requests only."""
    return paired_ratio([row.paired_tok_per_s[i] for i in requests], [base.paired_tok_per_s[i] for i in requests],
                        row.tok_per_s, base.tok_per_s)


def speedup_by_turn(rows: list[Row], base: Row, loop: AgentLoop) -> list[str]:
    """Each batch-1 row's speed over ``base``'s (plain decoding's) by session turn: ``rows.paired_ratio`` over the
    turn's requests. The first turn prefills its whole prompt and has only the prompt to draft from; later turns
    find the session in the prefix cache and the model's earlier answers in it."""
    by_turn: dict[int, list[int]] = {}
    for i, (_, t) in enumerate(loop.where):
        by_turn.setdefault(t, []).append(i)
    lines = ["", "By session turn (batch 1, x plain decoding, the median over the turn's requests):", ""]
    for r in rows:
        if r.system != "leapdecode" or r.batch != 1 or r is base:
            continue
        cells = [f"turn {t + 1} {_ratio_over(r, base, idx):.2f}x" for t, idx in sorted(by_turn.items())]
        lines.append(f"- {r.method}{f' [{r.kernel}]' if r.kernel else ''}: " + ", ".join(cells))
    return lines


def prompt_token_ids(llm: LLM, prompts: list[str], raw: bool, max_prompt_tokens: int | None) -> list[list[int]]:
    """Each prompt as one user turn through the model's chat template (``raw``: plain text), cut to its last
    ``max_prompt_tokens`` tokens."""
    tok = llm.engine.tokenizer
    if raw:
        ids = [tok.encode(p) for p in prompts]
    else:
        check_chat_template(llm)
        ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [x[-max_prompt_tokens:] for x in ids] if max_prompt_tokens else ids


def check_chat_template(llm: LLM) -> None:
    if not getattr(llm.engine.tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template (a base model's checkpoint often has none): run with --raw "
                         "to send the prompts as plain text")


def load_workload(llm: LLM, name: str, limit: int | None, raw: bool, max_prompt_tokens: int | None) -> Workload:
    """``--prompts NAME`` as a workload: ``agent_loop`` sessions, else a prompt set (``load_prompt_set``)."""
    if name == AGENT_LOOP:
        if not raw:
            check_chat_template(llm)
        return AgentLoop(llm, agent_sessions(limit), raw, max_prompt_tokens)
    return Workload(prompt_token_ids(llm, load_prompt_set(name, limit), raw, max_prompt_tokens))


__all__ = ["AgentLoop", "Run", "Workload", "load_workload", "prompt_token_ids", "speedup_by_turn"]
