// The TypeScript SDK, unchanged, against the fleet's gRPC address (tests/fleet/test_fleet.py runs it):
// node ts_sdk_turns.mjs <the SDK's dist/esm/index.js> <address> <api key>. Prints one JSON line.
const [sdk, address, apiKey] = process.argv.slice(2);
const { Client, NotFoundError } = await import(sdk);
const client = new Client(address, { apiKey });
try {
  const session = await client.createSession({ tokens: [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51] });
  const streamed = [];
  for await (const id of session.generate({ maxTokens: 4, ignoreEos: true })) streamed.push(id);
  const before = await session.info();
  await session.append([7, 8, 9]);
  const result = await session.generate({ maxTokens: 4, ignoreEos: true }).result();
  const after = await session.info();
  let missing = null;
  try {
    await client.getSession("no-such-session");
  } catch (error) {
    missing = error instanceof NotFoundError ? "NotFoundError" : String(error);
  }
  console.log(JSON.stringify({
    sessionId: session.id, streamed: streamed.length, generated: result.usage.generatedTokens,
    newTokens: before.historyTokens + 3 - before.computedTokens, lastPrefillTokens: after.lastPrefillTokens, missing,
  }));
} finally {
  client.close();
}
