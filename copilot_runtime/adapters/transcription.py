"""Speech to text for the chat's microphone button: the `transcribe` route's service.

A `Transcriber` turns audio bytes into text. `OpenAITranscription` uses the official SDK's
`audio.transcriptions` (Whisper and its successors, or any OpenAI-compatible server at
`base_url`). A failure is a `TranscriptionError` whose code is one of those the CopilotKit
clients know (`rate_limited`, `auth_failed`, `invalid_audio_format`, `provider_error`,
`network_error`), with a message written for the user: never the provider's internals.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import structlog

from copilot_runtime._exceptions import TranscriptionError

__all__ = ["OpenAITranscription", "Transcriber"]

_log = structlog.get_logger("copilot_runtime.transcription")


@runtime_checkable
class Transcriber(Protocol):
    async def transcribe(self, audio: bytes, *, mime_type: str, filename: str) -> str:
        """The text spoken in `audio` (raises `TranscriptionError`)."""
        ...

    async def aclose(self) -> None:
        ...


class OpenAITranscription:
    """Transcription through OpenAI's audio API (`model`: `whisper-1`,
    `gpt-4o-mini-transcribe`, ...); `client` may be a ready `openai.AsyncOpenAI` (Azure)."""

    def __init__(self, model: str = "whisper-1", *, api_key: str | None = None,
                 base_url: str | None = None, client: Any = None, timeout: float = 60.0,
                 language: str | None = None) -> None:
        self.model = model
        self.language = language
        self._own = client is None
        self._api_key = api_key or ("sk-none" if base_url else None)
        self._base_url = base_url
        self._timeout = timeout
        self._client = client

    def _sdk(self) -> Any:
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(api_key=self._api_key, base_url=self._base_url,
                                              timeout=self._timeout, max_retries=1)
        return self._client

    async def transcribe(self, audio: bytes, *, mime_type: str, filename: str) -> str:
        import openai

        extra: dict[str, Any] = {"language": self.language} if self.language else {}
        try:
            result = await self._sdk().audio.transcriptions.create(
                model=self.model, file=(filename, audio, mime_type), **extra)
        except openai.RateLimitError:
            raise TranscriptionError("rate_limited", "Too many transcriptions right now; "
                                     "try again shortly") from None
        except (openai.AuthenticationError, openai.PermissionDeniedError):
            raise TranscriptionError("auth_failed", "The transcription service refused "
                                     "this server's credentials") from None
        except (openai.BadRequestError, openai.UnprocessableEntityError):
            raise TranscriptionError("invalid_audio_format", "The transcription service "
                                     "could not read this audio") from None
        except (openai.APITimeoutError, openai.APIConnectionError):
            raise TranscriptionError("network_error", "The transcription service could "
                                     "not be reached") from None
        except openai.APIStatusError as exc:
            _log.warning("transcription failed", status=exc.status_code)
            raise TranscriptionError("provider_error", "The transcription service failed "
                                     f"(HTTP {exc.status_code})") from None
        text = getattr(result, "text", result)
        return text if isinstance(text, str) else str(text)

    async def aclose(self) -> None:
        if self._own and self._client is not None:
            client, self._client = self._client, None
            await client.close()
