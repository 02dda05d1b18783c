"""The request bodies this server takes, as typed pydantic models of OpenAI's request schema (strict: no coercion).

Each model names the fields it checks and their ranges; fields it does not name pass through
(``extra="allow"``) to transformers, which refuses unknown ones itself (422). `validate.py`
validates a body against the model of its endpoint and turns the first error into a 400 naming
the field. What one field cannot say alone (an image that must decode, a message's content
required unless it calls tools) is a validator here or a rule in `validate.py`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TEXT_PARTS = ("text", "input_text", "output_text")
IMAGE_PARTS = ("image_url", "input_image")
MAX_STOP = 4

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
PositiveInt = Annotated[int, Field(ge=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^-?\d+$")]


def check_image(url: Any) -> Any:
    """An image must be an http(s) URL, or a data URL of base64 bytes that decode as an image."""
    url = url.url if isinstance(url, ImageURL) else url
    if url.startswith(("http://", "https://")):
        return url
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise ValueError(f"must be an https:// URL or a data:image/...;base64,... URL; got {url[:60]!r}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"is not valid base64: {exc}") from None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"does not decode as an image ({type(exc).__name__}: {exc})") from None
    return url


def _json_object(value: Any) -> Any:
    """Tool-call arguments: a JSON object, or a string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object (or a string of one)")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class URL(_Model):
    """``{"url": ...}``, as chat completions send media."""

    url: str


class ImageURL(URL):
    """An image's ``{"url": ...}``."""


class TextPart(_Model):
    """A text content part (chat: ``text``; Responses API: ``input_text``, ``output_text``)."""

    type: Literal["text", "input_text", "output_text"]
    text: str


class ImagePart(_Model):
    """An image content part (chat: ``image_url``, ``{"url"}``; Responses API: ``input_image``, a string)."""

    type: Literal["image_url", "input_image"]
    image_url: Annotated[NonEmptyStr | ImageURL, AfterValidator(check_image)]


class AudioData(_Model):
    """Base64 audio and its format."""

    data: NonEmptyStr
    format: str | None = None


class AudioPart(_Model):
    """Base64 audio (``{"data", "format"}`` or the data alone)."""

    type: Literal["input_audio"]
    input_audio: NonEmptyStr | AudioData


class VideoPart(_Model):
    """A video by URL (transformers' extension)."""

    type: Literal["video_url"]
    video_url: URL


class AudioURLPart(_Model):
    """An audio file by URL (transformers' extension)."""

    type: Literal["audio_url"]
    audio_url: URL


Part = Annotated[TextPart | ImagePart | AudioPart | VideoPart | AudioURLPart, Field(discriminator="type")]
Content = str | list[Part]


class Function(_Model):
    """A tool call's function: its name and arguments (a JSON object, or a string of one)."""

    name: str
    arguments: Annotated[Any, AfterValidator(_json_object)] = None


class ToolCall(_Model):
    """A tool call of an assistant message."""

    function: Function


class Message(_Model):
    """A chat message (content required unless it calls tools: `validate.check_chat`)."""

    role: Role
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None


class ToolFunction(_Model):
    """A tool's function: its name (its description and parameters go to the chat template as they are)."""

    name: str


class Tool(_Model):
    """A tool the model may call."""

    function: ToolFunction


class _Common(_Model):
    """The fields every generating endpoint shares: model, sampling, seed, stream, stop, generation_config."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stream: bool | None = None
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    n: Literal[1] | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_STOP)] | None = None
    generation_config: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatBody(_Common):
    """A ``/v1/chat/completions`` body."""

    #: Lists validated a chunk at a time (`validate.py`), each item as this model.
    chunked: ClassVar[dict[str, type[BaseModel]]] = {"messages": Message}

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = None
    tools: list[Tool] | None = None


class CompletionBody(_Common):
    """A ``/v1/completions`` body."""

    prompt: NonEmptyStr
    max_tokens: PositiveInt | None = None
    suffix: str | None = None


class InputItem(_Model):
    """A Responses API input item: a message (``role``, ``content``), or another item named by its ``type``."""

    type: str | None = None
    role: Role | None = None
    content: Content | None = None


class ResponseBody(_Common):
    """A ``/v1/responses`` body."""

    chunked: ClassVar[dict[str, type[BaseModel]]] = {"input": InputItem}

    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    max_output_tokens: PositiveInt | None = None
    instructions: str | None = None


# Fields of a generation_config with the values this server can honour (one answer, streamed token by token).
class GenerationSettings(_Model):
    """The fields of a request's ``generation_config`` JSON that this server bounds (the rest: `GenerationConfig`'s)."""

    num_beams: Literal[1] | None = None
    num_return_sequences: Literal[1] | None = None
    max_new_tokens: PositiveInt | None = None
    min_new_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    top_p: Probability | None = None
    min_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
