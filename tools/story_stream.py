"""One streaming chat client, "Tell me story number i", shared by the fault tests and the fault benchmark.

Both kill a part of the mesh once every stream is decoding (`started` is set at the first content)
and then compare what each stream received with the no-fault run: the text, the completion tokens
the usage chunk counted, and the longest pause between two chunks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import openai


@dataclass
class StoryStream:
    """What one stream has received so far; filled in as chunks arrive, so a failed stream keeps its part."""

    text: str = ""
    tokens: int = 0
    longest_gap_s: float = 0.0


async def stream_story(client: openai.AsyncOpenAI, model: str, i: int, started: asyncio.Event, max_tokens: int,
                       story: StoryStream | None = None, *, temperature: float = 0.0, seed: int | None = None
                       ) -> StoryStream:
    """Stream story `i` (ignoring EOS, so every stream runs `max_tokens`); raises what the client raises."""
    story = story if story is not None else StoryStream()
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me story number {i}."}], max_tokens=max_tokens,
        temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    last = time.monotonic()
    async for chunk in response:
        now = time.monotonic()
        if story.text:
            story.longest_gap_s = max(story.longest_gap_s, now - last)
        last = now
        if chunk.choices:
            story.text += chunk.choices[0].delta.content or ""
            if story.text:
                started.set()
        if chunk.usage:
            story.tokens = chunk.usage.completion_tokens
    return story
