// A tenant's client with npm `nats` 2.x, or its 3.x successor (`@nats-io/transport-node` +
// `@nats-io/jetstream`), in its DEFAULT configuration (no inboxPrefix; docs/security.md "Tenants"):
// `node tenant.mjs CREDS.json BLOCK_ID [v2|v3]`. It watches its block (a core subscription),
// creates it (a JetStream publish: the PubAck comes back on its own inbox), waits for `ready`, sends
// it a task, scales it to 2, asks for a block that is not its own, and deletes its block. Prints one
// JSON object: what each step got, and the events it saw.
import fs from "node:fs";

const [credsPath, bid, version = "v2"] = process.argv.slice(2);
const creds = JSON.parse(fs.readFileSync(credsPath, "utf8"));
// the two generations' APIs: 3.x has no JSONCodec and takes JetStream from its own package
const nats = await import(version === "v3" ? "@nats-io/transport-node" : "nats");
const { connect, headers } = nats;
const jetstream = version === "v3" ? (await import("@nats-io/jetstream")).jetstream : (nc) => nc.jetstream();
const te = new TextEncoder();
const td = new TextDecoder();
const jc = { encode: (v) => te.encode(JSON.stringify(v)), decode: (b) => JSON.parse(td.decode(b)) };
const out = { events: [], errors: [] };

// its timer is cleared once p settles: a pending one kept node running for its whole ms
// after the script's work was done (60 s of every run waited out)
const within = (ms, p, what) => {
  let timer;
  const late = new Promise((_, no) => { timer = setTimeout(() => no(new Error(`${what}: nothing after ${ms} ms`)), ms); });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
};

function statusOf(m) {
  return { status: Number(m.headers?.get("Aios-Status") || "200"), error: m.headers?.get("Aios-Error") || "" };
}

async function main() {
  const nc = await connect({ servers: creds.url.replace(/^nats:\/\//, ""), user: creds.user, pass: creds.password,
                             reconnect: false, timeout: 10000 });
  (async () => { for await (const s of nc.status()) if (s.type === "error") out.errors.push(String(s.data)); })();
  const seen = new Set();
  const waiters = [];
  const sub = nc.subscribe(`aios.block.${bid}.>`);
  (async () => {
    for await (const m of sub) {
      const kind = m.subject.slice(`aios.block.${bid}.`.length);
      out.events.push(kind);
      seen.add(kind);
      for (const w of waiters) w();
    }
  })();
  const until = (kind, ms = 60000) => within(ms, new Promise((ok) => {
    const check = () => { if (seen.has(kind)) ok(kind); };
    waiters.push(check);
    check();
  }), `event ${kind}`);
  await nc.flush();

  const h = headers();
  h.set("Content-Type", "application/cloudevents+json");
  const event = { specversion: "1.0", id: `js-${bid}`, source: "urn:js-tenant", type: "io.aios.block.create",
                  data: { blockComponentURI: "aios://test/model", minInstances: 1, maxInstances: 3 } };
  const ack = await jetstream(nc).publish(`aios.block.${bid}.create`, jc.encode(event), { headers: h });
  out.create = { stream: ack.stream, seq: ack.seq };
  await until("ready");
  const task = await nc.request(`aios.block.${bid}.task`, jc.encode({ hello: "js" }), { timeout: 60000 });
  out.task = { ...statusOf(task), body: jc.decode(task.data) };
  const scale = await nc.request(`aios.block.${bid}.scale`, jc.encode({ target: 2 }), { timeout: 30000 });
  out.scale = { ...statusOf(scale), body: jc.decode(scale.data) };
  await until("scale.target");
  let added = 0;
  await within(60000, new Promise((ok) => {
    const check = () => {
      added = out.events.filter((k) => k.startsWith("instance.") && k.endsWith(".added")).length;
      if (added >= 2) ok();
    };
    waiters.push(check);
    check();
  }), "a second instance");
  out.added = added;
  const foreign = await nc.request(`aios.block.${bid}-not-mine.delete`, new Uint8Array(), { timeout: 30000 });
  out.foreign = statusOf(foreign);
  const del = await nc.request(`aios.block.${bid}.delete`, new Uint8Array(), { timeout: 30000 });
  out.delete = statusOf(del);
  await until("deleted");
  await nc.drain();
}

// a failed step leaves its connection open: exit, or node would run until pytest's timeout
main().then(() => console.log(JSON.stringify(out)), (err) => {
  out.fatal = String(err && err.message || err);
  console.log(JSON.stringify(out));
  process.exit(1);
});
