"""End-to-end check with the official `openai` Python SDK: the only change is the base URL.

Usage: python openai_sdk_e2e.py PROXY_BASE_URL MOCK_BASE_URL
Each answer through the proxy must equal the same call made directly against the mock.
"""

import sys

import openai


def chat(client, **kwargs):
    return client.chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "Hello from the SDK"}],
        **kwargs,
    )


def streamed_text(stream):
    text, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
    return "".join(text), usage


def main():
    proxy = openai.OpenAI(base_url=sys.argv[1], api_key="sk-test", max_retries=0)
    direct = openai.OpenAI(base_url=sys.argv[2], api_key="sk-test", max_retries=0)

    # Non-streaming.
    via_proxy, straight = chat(proxy), chat(direct)
    assert via_proxy.choices[0].message.content, via_proxy
    assert via_proxy.model_dump() == straight.model_dump(), (via_proxy, straight)

    # Streaming, without and with usage.
    text, usage = streamed_text(chat(proxy, stream=True))
    expected, _ = streamed_text(chat(direct, stream=True))
    assert text == expected and text, (text, expected)
    assert usage is None, "usage appeared although the client did not ask for it"
    text, usage = streamed_text(chat(proxy, stream=True, stream_options={"include_usage": True}))
    assert text == expected
    assert usage is not None and usage.total_tokens > 0, usage

    # Raw response headers reach the SDK.
    raw = proxy.chat.completions.with_raw_response.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers.get("x-engram-memory") == "skipped", dict(raw.headers)

    # Pass-through of another /v1 route.
    assert [m.id for m in proxy.models.list()] == [m.id for m in direct.models.list()]

    # Errors arrive in OpenAI's shape, so the SDK raises its typed exceptions.
    try:
        proxy.chat.completions.create(model="gpt-test", messages=[])
    except openai.BadRequestError as error:
        assert error.status_code == 400
        assert error.body["type"] == "invalid_request_error", error.body
    else:
        raise AssertionError("an empty messages list must be rejected")
    try:
        chat(proxy, extra_headers={"x-mock-status": "429"})
    except openai.RateLimitError as error:
        assert error.response.headers.get("retry-after") == "1"
    else:
        raise AssertionError("the upstream's 429 must reach the SDK")

    print("openai SDK end-to-end: all checks passed")


if __name__ == "__main__":
    main()
