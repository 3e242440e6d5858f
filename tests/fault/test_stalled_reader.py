"""Clients that open generate streams and never read them (over gRPC, and an OpenAI SSE stream on a socket
with a tiny receive buffer, so TCP itself pushes back): the engine still runs everyone else's turns, the
server keeps answering, the stalled generations end on the server (their sessions are not held busy by
their readers), memory stays bounded, and once the stalled clients go away their sessions take turns."""

from __future__ import annotations

import json
import random
import socket

from kiln.client import Client
from tests.fault.ledger import GREEDY, PROMPT_TOKENS, Workload, eventually, new_ledgers
from tests.fault.node import CONTEXT, Node

AGENTS = 3
STALLED = 4
LONG = CONTEXT - PROMPT_TOKENS - 2 * GREEDY["max_tokens"]  # a generation as long as the context allows
RSS_GROWTH_BOUND = 256 * 2**20  # generous: what the stalled streams buffer is a few thousand small events


def stalled_sse(node: Node, prompt: list[int]) -> socket.socket:
    """A streamed completion with logprobs (the largest events) whose socket is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", node.ports[1]))
    body = json.dumps({"model": "kiln", "prompt": prompt, "max_tokens": LONG, "stream": True, "logprobs": 5,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_stalled_stream_readers_hold_up_no_one(model, tmp_path):
    node = Node(model, ("--snapshot-dir", str(tmp_path / "store"))).start()
    rng = random.Random(11)
    try:
        stalled_client = Client(node.address)
        stalled = new_ledgers(stalled_client, STALLED, rng)
        rss_before = node.rss_bytes()
        streams = [stalled_client.get_session(ledger.session_id).generate(max_tokens=LONG, ignore_eos=True, logprobs=True)
                   for ledger in stalled]
        sse = stalled_sse(node, stalled[0].prompt)
        with Client(node.address) as client:
            workload = Workload(client, new_ledgers(client, AGENTS, rng), seed=11).start()
            workload.wait_turns(5 * AGENTS)
            workload.stop()
            assert client.health().status == "serving"
            histories = {ledger.session_id: PROMPT_TOKENS + LONG for ledger in stalled}
            eventually(lambda: all(not (info := client.get_session(s).info()).generating and info.history_tokens == n
                                   for s, n in histories.items()), 120, "the stalled generations ended on the server")
        assert node.rss_bytes() - rss_before < RSS_GROWTH_BOUND
        assert len(streams) == STALLED  # never read, until here
        stalled_client.close()
        sse.close()
        with Client(node.address) as client:
            for ledger in stalled:
                assert len(client.get_session(ledger.session_id).generate(**GREEDY).result().token_ids) == GREEDY["max_tokens"]
    finally:
        node.discard()
