"""ShareGPT conversations rendered with the target's own chat template (the prompts :mod:`.regenerate` lets the
target answer, and :mod:`.original` renders with their own answers).

Records are ShareGPT ``{"conversations": [{"from", "value"}]}`` or chat-style ``{"messages": [{"role",
"content"}]}``; a record that cannot be used raises :class:`_Skip` with one of :data:`SKIP_REASONS`.
"""

from __future__ import annotations

ROLE_MAP = {"human": "user", "gpt": "assistant", "system": "system"}
ROLE_ALIASES = {"user": "human", "assistant": "gpt"}  # chat-template role names, accepted in the "from" field
SKIP_REASONS = ("malformed", "unknown_role", "no_human_turn", "empty_turn", "prompt_too_long", "filtered_out")
_SENTINEL = "\u2063dflash2-sentinel\u2063"


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def conversation_turns(record: dict, max_turns: int, with_answers: bool = False):
    """``(system text or None, [human turn texts])`` usable from a ShareGPT record, at most ``max_turns`` humans.

    Leading system turns become the system message; leading ``gpt`` turns (a conversation split mid-way) are
    dropped; then human turns are taken while turns alternate human / gpt. Raises ``_Skip(reason)`` for bad
    records (see :data:`SKIP_REASONS`). ``with_answers``: a third item, the record's own answer after each kept
    human turn (``[str]``, one shorter when the conversation ends on a human turn).
    """
    # ShareGPT {"conversations": [{"from", "value"}]}, or the chat form {"messages": [{"role", "content"}]}
    convs = (record.get("conversations", record.get("messages"))) if isinstance(record, dict) else None
    if not isinstance(convs, list) or not all(isinstance(t, dict) for t in convs):
        raise _Skip("malformed")
    turns = []
    for t in convs:
        role, value = t.get("from", t.get("role")), t.get("value", t.get("content"))
        if not isinstance(value, str):
            raise _Skip("malformed")
        turns.append({"from": ROLE_ALIASES.get(role, role) if isinstance(role, str) else None, "value": value})
    if any(turn["from"] not in ROLE_MAP for turn in turns):
        raise _Skip("unknown_role")
    convs = turns
    i = 0
    systems = []
    while i < len(convs) and convs[i]["from"] == "system":
        systems.append(convs[i]["value"])
        i += 1
    while i < len(convs) and convs[i]["from"] == "gpt":
        i += 1
    if i >= len(convs):
        raise _Skip("no_human_turn")
    humans, answers = [], []
    expect = "human"
    for turn in convs[i:]:
        if turn["from"] != expect or len(humans) >= max_turns and expect == "human":
            break
        if expect == "human":
            if not turn["value"].strip():
                if not humans:
                    raise _Skip("empty_turn")
                break
            humans.append(turn["value"])
        else:
            answers.append(turn["value"])
        expect = "gpt" if expect == "human" else "human"
    system = "\n\n".join(s for s in systems if s.strip()) or None
    return (system, humans, answers) if with_answers else (system, humans)


def _messages(system: str | None, humans: list[str], answers: list[str], upto: int, with_answer: bool) -> list:
    msgs = [{"role": "system", "content": system}] if system else []
    for k in range(upto):
        msgs.append({"role": "user", "content": humans[k]})
        if k < upto - 1 or with_answer:
            msgs.append({"role": "assistant", "content": answers[k]})
    return msgs


def _render(tokenizer, msgs: list, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    # the template text already holds the special tokens (bos etc.): same as apply_chat_template(tokenize=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _Conv:
    """One conversation being regenerated."""

    __slots__ = ("record_id", "source_id", "system", "humans", "answers", "ids", "spans", "truncated")

    def __init__(self, record_id, source_id, system, humans, ids):
        self.record_id, self.source_id, self.system, self.humans = record_id, source_id, system, humans
        self.answers: list[str] = []
        self.ids: list[int] = ids
        self.spans: list[list[int]] = []
        self.truncated = False

    def to_json(self) -> dict:
        return {"record_id": self.record_id, "source_id": self.source_id, "input_ids": self.ids,
                "response_spans": self.spans, "num_response_tokens": sum(e - s for s, e in self.spans),
                "num_turns": len(self.spans), "truncated": self.truncated}


def _next_turn_delta(tokenizer, conv: _Conv, stop_token: int) -> str | None:
    """Template text between the stop token of the last response and the next assistant content (None if the
    template does not render the conversation append-only, so the next turn cannot be placed)."""
    k = len(conv.answers)
    full_prev = _render(tokenizer, _messages(conv.system, conv.humans, conv.answers, k, True), False)
    marked = list(conv.answers)
    marked[-1] = marked[-1] + _SENTINEL
    with_mark = _render(tokenizer, _messages(conv.system, conv.humans, marked, k, True), False)
    cut = with_mark.rfind(_SENTINEL)
    if cut < 0:
        return None
    suffix = with_mark[cut + len(_SENTINEL):]
    stop_text = tokenizer.convert_ids_to_tokens(stop_token)
    if not isinstance(stop_text, str) or not suffix.startswith(stop_text):
        return None
    nxt = _render(tokenizer, _messages(conv.system, conv.humans, conv.answers, k + 1, False), True)
    if not nxt.startswith(full_prev) or not full_prev.endswith(suffix):
        return None
    return suffix[len(stop_text):] + nxt[len(full_prev):]
