/**
 * The CommonJS build: `require("@kiln/client")` gives the same surface, and it talks to a real server.
 * (A .cts file: tsc compiles it to .cjs, whose imports become require calls.)
 */
import assert = require("node:assert/strict");
import test = require("node:test");

import kiln = require("@kiln/client");

test.it("require() loads the CommonJS build, which works against a real server", async () => {
  assert.equal(typeof kiln.Client, "function");
  assert.ok(new kiln.NotFoundError("gone") instanceof kiln.KilnError);
  assert.equal(new kiln.DeadlineExceededError("late").code, "DEADLINE_EXCEEDED");
  const { open } = JSON.parse(process.env.KILN_TEST_SERVERS ?? "{}") as { open: { grpcAddress: string } };
  const client = new kiln.Client(open.grpcAddress);
  try {
    const session = await client.createSession({ tokens: [1, 2, 3] });
    const result = await session.generate({ maxTokens: 2, ignoreEos: true }).result();
    assert.equal(result.usage.generatedTokens, 2);
    await assert.rejects(client.getSession("x".repeat(22)), kiln.NotFoundError);
  } finally {
    client.close();
  }
});
