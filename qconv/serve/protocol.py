"""The OpenAI request bodies we accept (pydantic, so a wrong type is a 400 naming the field) and the OpenAI error
body `{"error": {"message", "type", "param", "code"}}` every failure is answered with."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error the HTTP layer answers as an OpenAI error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Bounds every numeric field is checked against here, so no value reaches torch that it cannot hold (a seed past
# 64 bits, a top_k past int64) and one bad request is a 400, not a failure inside the batch it would join.
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_STOP_CHARS = 1024


class _Common(BaseModel):
    """Sampling fields shared by both endpoints. Unknown fields are ignored (clients send many we do not use)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)  # vLLM extension; 0 and -1 mean off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP_CHARS)
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: dict | None = None
    logprobs: bool | int | None = None  # not supported: refused rather than silently ignored
    logit_bias: dict[str, float] | None = None  # not supported: refused (a non-empty one) rather than ignored
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # applied in sampling (engine/sampling.py)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Not supported, each refused when it asks for something (see `refused`) rather than answered as if applied
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) of the first field that asks for what this server cannot do, or None. A field at its
        neutral value (a zero penalty, an empty bias, a text response format, no tools) asks for nothing."""
        fmt = (self.response_format or {}).get("type", "text")
        checks = (
            ("logprobs", bool(self.logprobs), "log-probabilities are not returned"),
            ("logit_bias", bool(self.logit_bias), "logit bias is not applied"),
            ("response_format", fmt != "text", f"response_format {fmt!r} is not enforced (only 'text')"),
            ("tools", bool(self.tools), "tool calls are not produced"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), "tool calls are not produced"),
            *self._refused_own(),
        )
        return next(((f, why) for f, asked, why in checks if asked), None)

    def _refused_own(self) -> tuple[tuple[str, bool, str], ...]:
        return ()

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"a stop sequence is longer than {MAX_STOP_CHARS} characters", param="stop")
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False  # not supported: refused
    suffix: str | None = None  # not supported: refused (a non-empty one)
    best_of: int | None = Field(default=None, ge=1, le=INT32_MAX)  # only 1

    def _refused_own(self) -> tuple[tuple[str, bool, str], ...]:
        return (
            ("echo", self.echo, "the prompt is not echoed"),
            ("suffix", bool(self.suffix), "insertion (a suffix) is not supported"),
            ("best_of", (self.best_of or 1) > 1, "only best_of=1 is supported"),
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(max_length=64)  # any: a non-text part (image_url, input_audio, ...) is refused by name
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self, where: str = "messages") -> str:
        if isinstance(self.content, list):
            for i, p in enumerate(self.content):
                if p.type != "text" or p.text is None:
                    raise APIError(
                        400,
                        f"{where}.content[{i}] is a {p.type!r} part: this server serves text only",
                        param=f"{where}.content",
                        code="text_only",
                    )
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)


def validation_error(errors: list[dict]) -> APIError:
    """FastAPI's validation errors (malformed JSON included) as one OpenAI-style 400."""
    e = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {e.get('msg')}", code="invalid_json")
    param = ".".join(loc) or None
    return APIError(400, f"{param or 'body'}: {e.get('msg')}", param=param, code="invalid_value")
