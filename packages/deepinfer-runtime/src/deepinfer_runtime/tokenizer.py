"""DeepSeek V4 / V4.1 tokenizer wrapper and chat-prompt renderer.

The chat format reproduces what `deepseek-recipe==0.2.0` (`DeepseekV4Encoding` / `DeepseekV41Encoding`) renders for
conversations made of system, user, assistant and tool messages, with conversation-level tools. Ids follow decisions
C9 (bos 0, eos 1, pad 2; BOS is prepended on request, EOS is never appended) and C10 (thinking on by default, default
effort `high`; `none` switches to chat mode).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer as _HFTokenizer

ChatFormat = Literal["v4", "v41"]

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"  # V4.1 only
THINK_START = "<think>"
THINK_END = "</think>"
DSML_TOKEN = "｜DSML｜"

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2  # decisions C9

_ROLES = ("system", "user", "assistant", "tool")

# decisions C10 / deepseek-recipe 0.2.0: named tiers of the V4.1 numeric effort.
V41_EFFORT = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
_V41_EFFORT_TEMPLATE = "Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

# V4 (DeepSeek-V4-Pro in the recipe) renders the tiers as fixed instructions; `low` renders nothing.
_V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
V4_EFFORT = {"low": "", "high": _V4_EFFORT_HIGH, "xhigh": _V4_EFFORT_HIGH, "max": _V4_EFFORT_MAX}

# DSML tag names: V4 uses `tool_calls`/`invoke`/`parameter`, V4.1 prefixes each with a space and renames the block.
_DSML_TAGS = {
    "v4": ("tool_calls", "invoke", "parameter"),
    "v41": (" calls", " invoke", " parameter"),
}

_TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<{d}{calls}>" block like the following:\n\n'
    "<{d}{calls}>\n"
    '<{d}{invoke} name="$TOOL_NAME">\n'
    '<{d}{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}{param}>\n'
    "...\n"
    "</{d}{invoke}>\n"
    '<{d}{invoke} name="$TOOL_NAME2">\n'
    "...\n"
    "</{d}{invoke}>\n"
    "</{d}{calls}>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class _Prompt:
    """A prompt under construction: text pieces tagged as special tokens or plain text."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, bool]] = []

    def special(self, token: str) -> None:
        self.parts.append((token, True))

    def text(self, text: str) -> None:
        if not text:
            return
        if self.parts and not self.parts[-1][1]:  # plain text runs are encoded as one piece
            self.parts[-1] = (self.parts[-1][0] + text, False)
        else:
            self.parts.append((text, False))

    def render(self) -> str:
        return "".join(p for p, _ in self.parts)


def resolve_thinking_and_effort(
    thinking: bool | None, reasoning_effort: str | int | None, chat_format: ChatFormat = "v41"
) -> tuple[bool, str | int]:
    """Apply decisions C10: returns (thinking, effort) with effort a tier name or an int 1-100."""
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking must be a bool or None, got {thinking!r}")
    effort: str | int | None = reasoning_effort
    if effort == "none":
        return False, DEFAULT_EFFORT
    if effort is None:
        effort = DEFAULT_EFFORT
    if isinstance(effort, bool) or not isinstance(effort, (str, int)):
        raise ValueError(f"invalid reasoning_effort {reasoning_effort!r}: expected low/high/xhigh/max/none or 1-100")
    if isinstance(effort, int):
        if not 1 <= effort <= 100:
            raise ValueError(f"invalid reasoning_effort {effort}: integers must be within 1-100")
        if chat_format == "v4":
            raise ValueError("integer reasoning_effort is only supported by the V4.1 chat format")
    elif effort not in V41_EFFORT:
        raise ValueError(f"invalid reasoning_effort {effort!r}: expected low/high/xhigh/max/none or an int 1-100")
    return (True if thinking is None else thinking), effort


def _norm_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be a dict")
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] has no function name")
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": fn.get("parameters")})
    return out


def _norm_tool_calls(calls: Any, where: str) -> list[tuple[str, str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ValueError(f"{where}: tool_calls must be a list")
    out = []
    for j, tc in enumerate(calls):
        if not isinstance(tc, Mapping):
            raise ValueError(f"{where}: tool_calls[{j}] must be a dict")
        fn = tc.get("function", tc)
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: tool_calls[{j}] has no function name")
        if not isinstance(args, (str, Mapping)):
            raise ValueError(f"{where}: tool_calls[{j}].arguments must be a JSON string or a dict")
        out.append((str(tc.get("id") or fn.get("id") or ""), name, args))
    return out


def _validate(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of dicts")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be a dict")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        tool_calls = _norm_tool_calls(m.get("tool_calls"), where) if role == "assistant" else []
        if "content" not in m and not tool_calls:
            raise ValueError(f"{where} ({role}) is missing 'content'")
        content = m.get("content")
        if content is None and role == "assistant" and tool_calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"{where} ({role}): content must be a string, got {type(content).__name__}")
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            rc = m.get("reasoning_content", m.get("reasoning"))
            if rc is not None and not isinstance(rc, str):
                raise ValueError(f"{where}: reasoning_content must be a string")
            msg["reasoning_content"] = rc
            msg["tool_calls"] = tool_calls
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None and not isinstance(tcid, str):
                raise ValueError(f"{where}: tool_call_id must be a string")
            msg["tool_call_id"] = tcid or ""
        out.append(msg)
    return out


def _dsml_calls(calls: list[tuple[str, str, Any]], chat_format: ChatFormat) -> str:
    block, invoke, param = _DSML_TAGS[chat_format]
    d = DSML_TOKEN
    rendered = []
    for _, name, args in calls:
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else {"arguments": args}
        params = [
            f'<{d}{param} name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _to_json(v)}</{d}{param}>"
            for k, v in args.items()
        ]
        body = "\n".join(params)
        if chat_format == "v41" or params:
            body += "\n"
        rendered.append(f'<{d}{invoke} name="{name}">\n{body}</{d}{invoke}>')
    return f"\n\n<{d}{block}>\n" + "\n".join(rendered) + f"\n</{d}{block}>"


def _tools_block(tools: list[dict[str, Any]], chat_format: ChatFormat) -> str:
    block, invoke, param = _DSML_TAGS[chat_format]
    header = _TOOLS_HEADER.format(d=DSML_TOKEN, calls=block, invoke=invoke, param=param)
    return header + "\n".join(_to_json(t) for t in tools) + _TOOLS_FOOTER


def _user_groups(body: list[dict[str, Any]], chat_format: ChatFormat) -> list[Any]:
    """Merge runs of user/tool messages into user turns, as the recipe does.

    Returns a list whose items are either a message dict (system/assistant) or a list of user/tool messages forming
    one `<｜User｜>` turn. V4.1 merges every run of user and tool messages; V4 starts a new turn when a tool message
    follows a user message.
    """
    items: list[Any] = []
    for m in body:
        if m["role"] in ("user", "tool"):
            prev = items[-1] if items and isinstance(items[-1], list) else None
            if prev is not None and chat_format == "v4" and m["role"] == "tool" and prev[-1]["role"] == "user":
                prev = None
            if prev is None:
                items.append([m])
            else:
                prev.append(m)
        else:
            items.append(m)
    return items


def _render_user_turn(group: list[dict[str, Any]], order: dict[str, int], chat_format: ChatFormat) -> str:
    tools = [m for m in group if m["role"] == "tool"]
    if len(tools) > 1 and order:
        # Tool results follow the call order of the preceding assistant message; unknown ids go first in V4.1
        # and last in V4 (stable otherwise).
        missing = 0 if chat_format == "v41" else len(order)
        tools = iter(sorted(tools, key=lambda m: order.get(m["tool_call_id"], missing)))
        group = [next(tools) if m["role"] == "tool" else m for m in group]
    parts = [f"<tool_result>{m['content']}</tool_result>" if m["role"] == "tool" else m["content"] for m in group]
    return "\n\n".join(parts)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool | None = None,
    reasoning_effort: str | int | None = None,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_format: ChatFormat = "v41",
) -> _Prompt:
    if chat_format not in _DSML_TAGS:
        raise ValueError(f"unknown chat_format {chat_format!r}; expected 'v4' or 'v41'")
    msgs = _validate(messages)
    thinking, effort = resolve_thinking_and_effort(thinking, reasoning_effort, chat_format)
    tool_defs = _norm_tools(tools)
    keep_reasoning = thinking and bool(tool_defs)

    p = _Prompt()
    p.special(BOS_TOKEN)
    if chat_format == "v4":
        # All system messages are hoisted into the leading block, after the effort instruction.
        system = "\n\n".join(m["content"] for m in msgs if m["role"] == "system")
        p.text((V4_EFFORT[effort] if thinking else "") + system)  # type: ignore[index]
        if tool_defs:
            _append_with_specials(p, "\n\n" + _tools_block(tool_defs, chat_format))
        body = [m for m in msgs if m["role"] != "system"]
    else:
        first_system = bool(msgs) and msgs[0]["role"] == "system"
        effort_text = ""
        if thinking and msgs:
            effort_text = _V41_EFFORT_TEMPLATE.format(n=effort if isinstance(effort, int) else V41_EFFORT[effort])
        if effort_text or first_system or tool_defs:
            p.special(SYSTEM_TOKEN)
            p.text(effort_text + (msgs[0]["content"] if first_system else ""))
            if tool_defs:
                _append_with_specials(p, "\n\n" + _tools_block(tool_defs, chat_format))
        body = msgs[1:] if first_system else msgs

    order: dict[str, int] = {}
    for item in _user_groups(body, chat_format):
        if isinstance(item, list):
            p.special(USER_TOKEN)
            p.text(_render_user_turn(item, order, chat_format))
        elif item["role"] == "system":  # V4.1 mid-conversation system message
            p.special(SYSTEM_TOKEN)
            p.text(item["content"])
        else:  # assistant
            p.special(ASSISTANT_TOKEN)
            rc = item["reasoning_content"]
            # With tools, V4.1 keeps every turn's reasoning in thinking mode (`<think></think>` when absent); V4
            # keeps the reasoning that is present, thinking mode or not. Otherwise past reasoning is dropped.
            if (chat_format == "v41" and keep_reasoning) or (chat_format == "v4" and tool_defs and rc is not None):
                p.special(THINK_START)
                p.text(rc or "")
            p.special(THINK_END)
            p.text(item["content"])
            if item["tool_calls"]:
                order = {cid: k for k, (cid, _, _) in enumerate(item["tool_calls"]) if cid}
                _append_with_specials(p, _dsml_calls(item["tool_calls"], chat_format))
            p.special(EOS_TOKEN)
    if add_generation_prompt:
        p.special(ASSISTANT_TOKEN)
        p.special(THINK_START if thinking else THINK_END)
    return p


_TEMPLATE_SPECIALS = re.compile("(" + "|".join(re.escape(t) for t in (DSML_TOKEN, THINK_END, THINK_START)) + ")")


def _append_with_specials(p: _Prompt, text: str) -> None:
    """Append template markup (tools block, DSML calls); `｜DSML｜`, `<think>`, `</think>` in it are special tokens."""
    for k, piece in enumerate(_TEMPLATE_SPECIALS.split(text)):
        if k % 2:
            p.special(piece)
        else:
            p.text(piece)


class Tokenizer:
    """DeepSeek V4 / V4.1 tokenizer: `tokenizer.json` (+ `tokenizer_config.json`) from a directory.

    `chat_format` selects the V4 or V4.1 chat rendering; by default it is V4.1 when the vocabulary has a
    `<｜System｜>` token and V4 otherwise.
    """

    def __init__(self, path: str | Path, *, chat_format: ChatFormat | None = None) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json" if path.is_dir() else path
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok_file}")
        self.directory = tok_file.parent
        self._tok = _HFTokenizer.from_file(str(tok_file))
        cfg_file = self.directory / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        self.model_max_length: int | None = self.config.get("model_max_length")

        self.bos_id, self.eos_id, self.pad_id = BOS_ID, EOS_ID, PAD_ID  # decisions C9
        for tid, text in ((BOS_ID, BOS_TOKEN), (EOS_ID, EOS_TOKEN), (PAD_ID, PAD_TOKEN)):
            if self._tok.id_to_token(tid) != text:
                raise ValueError(f"{tok_file}: id {tid} is {self._tok.id_to_token(tid)!r}, expected {text!r}")

        added = self._tok.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added = {t.content: i for i, t in added.items()}
        if chat_format is None:
            chat_format = "v41" if SYSTEM_TOKEN in self._added else "v4"
        if chat_format not in _DSML_TAGS:
            raise ValueError(f"unknown chat_format {chat_format!r}; expected 'v4' or 'v41'")
        self.chat_format: ChatFormat = chat_format
        self._plain: _HFTokenizer | None = None

    # ---------------------------------------------------------------- basic API
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        """True for special tokens (those `decode(..., skip_special_tokens=True)` drops)."""
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text` (special-token spellings become their ids); BOS prepended if asked, never EOS."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- chat
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool | None = None,
        reasoning_effort: str | int | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_format: ChatFormat | None = None,
    ) -> str:
        """Render `messages` as a DeepSeek V4/V4.1 prompt string (BOS included)."""
        return render_chat(
            messages,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_format=chat_format or self.chat_format,
        ).render()

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool | None = None,
        reasoning_effort: str | int | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_format: ChatFormat | None = None,
    ) -> list[int]:
        """Token ids of the rendered prompt.

        Like the recipe's prompt encoding, the template's special tokens become their ids while message text is
        encoded without the added vocabulary, so a user writing `<think>` gets plain text, not the token.
        """
        prompt = render_chat(
            messages,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_format=chat_format or self.chat_format,
        )
        ids: list[int] = []
        for text, special in prompt.parts:
            if special:
                tid = self._added.get(text)
                if tid is None:
                    raise ValueError(f"chat token {text!r} is not in this tokenizer's vocabulary")
                ids.append(tid)
            else:
                ids.extend(self._plain_tokenizer().encode(text, add_special_tokens=False).ids)
        return ids

    def _plain_tokenizer(self) -> _HFTokenizer:
        if self._plain is None:
            spec = json.loads(self._tok.to_str())
            spec["added_tokens"] = []
            self._plain = _HFTokenizer.from_str(json.dumps(spec))
        return self._plain
