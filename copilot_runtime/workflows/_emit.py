"""Messages a workflow node writes itself (not a model), streamed to the client in order.

A message a node only returns in its state update reaches the client in the run's closing
`MESSAGES_SNAPSHOT`, after whatever a model streamed meanwhile, so the chat would show it
out of order. `say` also streams it at once, through the CopilotKit custom event the
runtime turns into `TEXT_MESSAGE_*` events, with the id the state keeps.
"""

from __future__ import annotations

import uuid

from langchain_core.callbacks.manager import adispatch_custom_event
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig

__all__ = ["say"]


async def say(text: str, config: RunnableConfig | None) -> AIMessage:
    """An assistant message for the state update, announced to the client now."""
    message = AIMessage(content=text, id=str(uuid.uuid4()))
    if config is not None:
        await adispatch_custom_event(
            "copilotkit_manually_emit_message",
            {"message_id": message.id, "message": text, "role": "assistant"}, config=config)
    return message
