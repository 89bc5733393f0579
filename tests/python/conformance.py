"""Client patterns of real apps, driven by the official `openai` SDK through engram.

Usage: ENGRAM_ADMIN_TOKEN=... python conformance.py PATTERN PROXY_BASE_URL

Each pattern plays one kind of client against engram in front of `engram-mock`; the
mock records every prompt it received, and the Rust side (tests/conformance.rs) checks those.
This script prints one JSON line per request with the `x-engram-*` response headers it got.

Patterns:
  resend         a chat loop that resends its whole history (non-streaming)
  resend-stream  the same, streamed
  resend-window  a chat loop that resends only its last four exchanges (a sliding window)
  stateless      a loop that sends only its latest message, each follow-up the instant the
                 answer ends (streamed and not, alternately)
  agent          a tool-calling agent that resends its history, tool calls and results included
  agent-stateless  the same agent sending only the latest turn's messages
  parallel       one user, four sessions at once, each resending its history
  user-field     an app that sets the body's `user` (no engram headers), stateless
"""

import json
import os
import sys
import threading
import time
import urllib.request

import openai

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}

# Line 7 of this block is what "change line 7" needs intact.
CODE = """Here is my script:
```python
import csv


def total(rows):
    result = 0
    for row in rows:
        result += float(row["price"]) * int(row["qty"])  # line 7
    return result


def main(path):
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    print(f"{total(rows):.2f}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1])
```
Please remember it."""


def question(turn, first_marker=0):
    """The user's message of a turn: a question with a marker word of its own
    (`mk<first_marker + turn>x`)."""
    marker = first_marker + turn
    if turn == 2:
        return CODE + f" Marker mk{marker}x."
    return f"Question mk{marker}x: what rhymes with orange number {turn}?"


def headers_of(raw):
    return {k: v for k, v in raw.headers.items() if k.lower().startswith("x-engram-")}


PRINTING = threading.Lock()


def report(pattern, turn, raw, **extra):
    line = json.dumps({"pattern": pattern, "turn": turn, "headers": headers_of(raw), **extra})
    with PRINTING:
        print(line, flush=True)


def create(client, headers, stream, **kwargs):
    """One chat completion; returns (raw response, assistant message dict)."""
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", extra_headers=headers, stream=stream, **kwargs
    )
    parsed = raw.parse()
    if not stream:
        message = parsed.choices[0].message
        out = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in message.tool_calls
            ]
        return raw, out
    content, calls = [], {}
    for chunk in parsed:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
    out = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    return raw, out


def wait_applied(base):
    """Waits until the proxy's worker has applied every recorded turn (the management API's
    queue, with the token in ENGRAM_ADMIN_TOKEN)."""
    root = base.rsplit("/v1", 1)[0]
    request = urllib.request.Request(
        root + "/engram/v1/queue",
        headers={"authorization": "Bearer " + os.environ["ENGRAM_ADMIN_TOKEN"]},
    )
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(request) as response:
            queue = json.load(response)
        if queue["depth"] == 0 and queue["recorded"]["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, queue
        time.sleep(0.05)


def chat_loop(
    client, pattern, user, session, turns, resend, stream_of, settle_from=None, window=None, first_marker=0
):
    """A chat loop; from turn `settle_from` on, each turn waits for the worker first (a user
    who reads the answer), the turns before it follow at once. A resending client with a
    `window` resends only its last `window` exchanges. Its turns' markers start at
    `first_marker`."""
    headers = {"x-engram-user": user, "x-engram-session": session, "x-mock-script": "parrot"}
    history = [SYSTEM]
    for turn in range(turns):
        if settle_from is not None and turn >= settle_from:
            wait_applied(str(client.base_url))
        asked = {"role": "user", "content": question(turn, first_marker)}
        kept = history[1:] if window is None else history[1:][-2 * window:]
        messages = [SYSTEM] + kept + [asked] if resend else [SYSTEM, asked]
        raw, answer = create(client, headers, stream_of(turn), messages=messages)
        assert answer["content"] == "You said: " + asked["content"], answer
        report(pattern, turn, raw, session=session)
        history += [asked, answer]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Looks a word up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


def agent(client, pattern, resend, turns=4):
    headers = {"x-engram-user": "agent", "x-engram-session": "a1", "x-mock-script": "tool:lookup"}
    history = [SYSTEM]
    for turn in range(turns):
        asked = {"role": "user", "content": question(turn)}
        loop = [asked]
        rounds = 0
        while True:
            messages = (history if resend else [SYSTEM]) + loop
            raw, answer = create(client, headers, rounds % 2 == 1, messages=messages, tools=TOOLS)
            report(pattern, turn, raw, round=rounds)
            rounds += 1
            loop.append(answer)
            if not answer.get("tool_calls"):
                break
            assert rounds < 4, "the tool loop does not end"
            for call in answer["tool_calls"]:
                result = json.dumps({"word": f"mk{turn}x", "rhymes": ["door hinge", "sporange"]})
                loop.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        assert answer["content"].startswith("lookup says: "), answer
        history += loop


def main():
    pattern, base = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base, api_key="sk-test", max_retries=0)
    if pattern == "resend":
        chat_loop(client, pattern, "resender", "r1", 10, True, lambda turn: False, 5)
    elif pattern == "resend-stream":
        chat_loop(client, pattern, "streamer", "r1", 10, True, lambda turn: True, 5)
    elif pattern == "resend-window":
        chat_loop(client, pattern, "window", "w1", 10, True, lambda turn: turn % 2 == 0, 3, 4)
    elif pattern == "stateless":
        chat_loop(client, pattern, "stateless", "s1", 10, False, lambda turn: turn % 2 == 1)
    elif pattern == "agent":
        agent(client, pattern, True)
    elif pattern == "agent-stateless":
        agent(client, pattern, False)
    elif pattern == "parallel":
        errors = []

        # Each session its own markers: a session asking what another already asked may be shown
        # that exchange in its recall, and one marker would then count it twice.
        def run(n):
            try:
                chat_loop(client, pattern, "parallel", f"p{n}", 4, True, lambda t: t % 2 == 0, first_marker=10 * n)
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(repr(error))

        threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
    elif pattern == "user-field":
        for turn in range(3):
            raw, answer = create(
                client,
                {"x-mock-script": "parrot"},
                False,
                messages=[SYSTEM, {"role": "user", "content": question(turn)}],
                user="josé@example.com",
            )
            report(pattern, turn, raw)
    else:
        raise SystemExit(f"unknown pattern {pattern}")


if __name__ == "__main__":
    main()
