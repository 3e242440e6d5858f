// An agent's conversation as one Kiln session: each turn appends only its new text, and the server
// prefills only that, reusing the K/V of everything before it. Against `make run` (Gemma 3 270M):
//
//   cd sdk/typescript && npm ci && node examples/agent.mjs
//
// KILN_ADDRESS (default 127.0.0.1:50051) and KILN_API_KEY pick another server.
import { CancelledError, Client, NotFoundError } from "@kiln/client";

const address = process.env.KILN_ADDRESS ?? "127.0.0.1:50051";
const client = new Client(address, { apiKey: process.env.KILN_API_KEY, tokenizer: "server" });
const health = await client.health();
console.log(`${health.model} at ${address}: ${health.vocabSize} token ids, context ${health.maxModelLen} tokens\n`);

// The served model is a base model: it continues text, so the conversation is a Q/A transcript.
const bos = await client.tokenize("", { addSpecialTokens: true });
const session = await client.createSession({ tokens: bos, ttlS: 3600 });
await session.appendText("Questions and answers about European geography.\n");

async function ask(on, question) {
  await on.appendText(`\nQ: ${question}\nA:`);
  const answer = await on.generateText({ maxTokens: 32, stop: ["\n"] }); // the whole reply, cut at the stop
  const { lastPrefillTokens, reusedTokens, historyTokens } = await on.info();
  console.log(`Q: ${question}\nA:${answer}`);
  console.log(`   [prefilled ${lastPrefillTokens}, reused ${reusedTokens} from cache; ${historyTokens} tokens of history]`);
}

await ask(session, "What is the capital of France?");
await ask(session, "And the capital of Italy?");
await ask(session, "Which of the two cities is further north?");

// A fork shares the history's K/V pages: another line of questioning from here recomputes nothing.
const aside = await session.fork();
await ask(aside, "Which river flows through Paris?");
await aside.close();

// Streamed text, stopped after two seconds by an AbortSignal: what was generated stays in the history.
const prompt = "\nQ: Tell me a long story about a kiln.\nA:";
await session.appendText(prompt);
process.stdout.write(prompt);
try {
  for await (const piece of session.generateText({ maxTokens: 400, signal: AbortSignal.timeout(2000) })) {
    process.stdout.write(piece);
  }
  console.log();
} catch (error) {
  if (!(error instanceof CancelledError)) throw error;
  console.log("\n  [stopped after 2 s]");
}

// Session ids outlive clients: another process could pick this conversation up by its id.
const later = new Client(address, { apiKey: process.env.KILN_API_KEY });
const again = await later.getSession(session.id);
console.log(`\nsession ${again.id}: ${(await again.info()).historyTokens} tokens of history`);
await again.close();
try {
  await later.getSession(session.id);
} catch (error) {
  if (!(error instanceof NotFoundError)) throw error;
  console.log(`closed: ${error.message}`);
}
later.close();
client.close();
