// A minimal AgentX-protocol client: creates a container and a conversation,
// sends one message and prints the reply as it streams.
// Usage: node --experimental-websocket scripts/ws-chat.mjs "your message" [ws://127.0.0.1:8080/ws]
// (Node 22+ needs no flag.) The credential is AVM_TOKEN, else the admin key
// the first `avm serve` wrote to ~/.agentvm/admin.key (or $AVM_SERVER_DATA_DIR).
// It goes in the first-frame `auth` event, as a browser client would send it.

import { readFileSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";

const text = process.argv[2] ?? "Hello, AgentVM!";
const url = process.argv[3] ?? "ws://127.0.0.1:8080/ws";
const dataDir = (process.env.AVM_SERVER_DATA_DIR ?? "~/.agentvm").replace(/^~/, homedir());
let token = process.env.AVM_TOKEN;
if (!token) {
  try {
    token = readFileSync(join(dataDir, "admin.key"), "utf8").trim();
  } catch {
    console.error(`no credential: set AVM_TOKEN or run \`avm serve\` once to create ${join(dataDir, "admin.key")}`);
    process.exit(1);
  }
}
const ws = new WebSocket(url);
let seq = 0;
const pending = new Map();

function request(type, data) {
  const requestId = `req_${++seq}`;
  ws.send(JSON.stringify({ type: `${type}_request`, timestamp: Date.now(), data: { ...data, requestId },
    source: "command", category: "request", intent: "request" }));
  return new Promise((resolve, reject) => pending.set(requestId, { resolve, reject }));
}

ws.onmessage = (message) => {
  const frame = JSON.parse(message.data);
  const waiter = frame.category === "response" && pending.get(frame.data.requestId);
  if (waiter) {
    pending.delete(frame.data.requestId);
    frame.data.error ? waiter.reject(new Error(`${frame.data.code}: ${frame.data.error}`)) : waiter.resolve(frame.data);
    return;
  }
  if (frame.type === "text_delta") process.stdout.write(frame.data.text);
  if (frame.type === "message_delta") console.log(`\n[usage ${JSON.stringify(frame.data.usage)}]`);
  if (frame.type === "error_occurred") console.error(`\n[error ${frame.data.code}: ${frame.data.message}]`);
  if (frame.type === "conversation_end" || frame.type === "error_occurred") ws.close();
};

ws.onopen = async () => {
  try {
    ws.send(JSON.stringify({ type: "auth", headers: { Authorization: `Bearer ${token}` } }));
    await request("container_create", { containerId: "default" });
    const image = await request("image_create", { containerId: "default", config: { name: "demo" } });
    ws.send(JSON.stringify({ type: "subscribe", sessionId: image.__subscriptions[0] }));
    await request("message_send", { imageId: image.record.imageId, content: text });
  } catch (error) {
    console.error(error.message);
    ws.close();
    process.exitCode = 1;
  }
};
ws.onclose = (event) => {
  if (event.code === 1008) { console.error(`refused: ${event.reason}`); process.exitCode = 1; }
};
ws.onerror = () => { console.error(`cannot connect to ${url}: is \`avm serve\` running?`); process.exitCode = 1; };
