"""Talk to an InferenceService's gateway with the OpenAI SDK.

The gateway's Service is named after the InferenceService and listens on 8080:

    kubectl -n ai port-forward svc/llama-8b 8080:8080 &
    KVFLEET_API_KEY=... python examples/openai_client.py

KVFLEET_URL (default http://127.0.0.1:8080/v1) and KVFLEET_MODEL (default llama-3.1-8b)
point it elsewhere.
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("KVFLEET_URL", "http://127.0.0.1:8080/v1"),
    api_key=os.environ["KVFLEET_API_KEY"],
)
stream = client.chat.completions.create(
    model=os.environ.get("KVFLEET_MODEL", "llama-3.1-8b"),
    messages=[{"role": "user", "content": "Why does prefix caching lower time to first token?"}],
    max_tokens=200,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt, {chunk.usage.completion_tokens} completion]")
