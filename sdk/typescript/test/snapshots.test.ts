/**
 * Snapshots through the SDK against a real `kiln serve` with persistence on: a checkpoint, a restore
 * that continues exactly like the original session, list and delete, and scoping to the API key.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { Client, InvalidArgumentError, NotFoundError } from "@kiln/client";

import { history, sharedServers } from "./helpers.js";

const { open, keyed } = sharedServers();
const GREEDY = { maxTokens: 6, ignoreEos: true };

describe("snapshots over a real kiln serve", () => {
  it("snapshot, restore (a branch that continues identically), list, delete", async () => {
    const client = new Client(open.grpcAddress);
    try {
      const session = await client.createSession({ tokens: history() });
      await session.generate(GREEDY).result();
      const snapshotId = await session.snapshot();
      const listed = await client.listSnapshots();
      const mine = listed.find((snapshot) => snapshot.snapshotId === snapshotId);
      assert.ok(mine !== undefined);
      assert.equal(mine.sessionId, session.id);
      assert.equal(mine.historyTokens, 40 + 6);
      assert.equal(mine.kvTokens, 40 + 6 - 1);

      const branch = await client.restoreSession(snapshotId);
      assert.notEqual(branch.id, session.id);
      const restored = await branch.generate(GREEDY).result();
      assert.equal(restored.usage.reusedTokens, 45, "the K/V came from the snapshot");
      assert.deepEqual(restored.tokenIds, (await session.generate(GREEDY).result()).tokenIds);

      await client.deleteSnapshot(snapshotId);
      assert.ok(!(await client.listSnapshots()).some((snapshot) => snapshot.snapshotId === snapshotId));
      await assert.rejects(client.restoreSession(snapshotId), NotFoundError);
      await assert.rejects(client.restoreSession(42 as unknown as string), InvalidArgumentError);
    } finally {
      client.close();
    }
  });

  it("another key's snapshot does not exist", async () => {
    const [a, b] = keyed.apiKeys.map((apiKey) => new Client(keyed.grpcAddress, { apiKey }));
    try {
      const session = await a!.createSession({ tokens: history() });
      const snapshotId = await session.snapshot();
      await assert.rejects(b!.restoreSession(snapshotId), NotFoundError);
      await assert.rejects(b!.deleteSnapshot(snapshotId), NotFoundError);
      assert.deepEqual(await b!.listSnapshots(), []);
      assert.equal((await (await a!.restoreSession(snapshotId)).info()).historyTokens, 40);
    } finally {
      a!.close();
      b!.close();
    }
  });
});
