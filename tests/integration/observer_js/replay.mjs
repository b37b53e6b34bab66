// An observer replaying stored events with the official JavaScript clients (docs/security.md
// "Observers: a user each"): `node replay.mjs v2|v3 CONFIG.json`, v2 = npm `nats` 2.x, v3 =
// `@nats-io/jetstream` + `@nats-io/transport-node` 3.x. Replays the config's subject from its stream
// through a consumer named after the observer's user (`<user>_<n>`, the only names it may use),
// acked message by message; then checks that an ordered consumer (which the client names itself)
// is refused, that another observer's consumer is out of reach (info, pull, delete), and a worker's
// consumer on the workers' stream too (pull from it, and the unnamed create that names it in its
// body). Prints one JSON object: what each replay got, and the client's error statuses.
import fs from "node:fs";

const [gen, configPath] = process.argv.slice(2);
const cfg = JSON.parse(fs.readFileSync(configPath, "utf8"));
const want = cfg.expected.length;
const out = { gen, replays: {}, worker: {}, errors: [] };

// its timer is cleared once p settles: a pending one kept node running for its whole ms
// after the script's work was done (60 s of every run waited out)
const within = (ms, p, what) => {
  let timer;
  const late = new Promise((_, no) => { timer = setTimeout(() => no(new Error(`${what}: nothing after ${ms} ms`)), ms); });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
};

async function take(iterable, n, stop) {
  const got = [];
  for await (const m of iterable) {
    got.push(m.subject);
    if (got.length >= n) break;
  }
  if (stop) await stop();
  return got;
}

async function attempt(name, fn) {
  try {
    out.replays[name] = await within(20000, fn(), name);
  } catch (err) {
    out.replays[name] = { error: String(err && err.message || err) };
  }
}

async function main() {
  let nc, js, jsm, api;
  const opts = { servers: cfg.servers, user: cfg.user, pass: cfg.pass, inboxPrefix: `_INBOX.${cfg.user}`,
                 reconnect: false, timeout: 10000 };
  if (gen === "v2") {
    api = await import("nats");
    nc = await api.connect(opts);
    js = nc.jetstream();
    jsm = await nc.jetstreamManager();
  } else {
    const transport = await import("@nats-io/transport-node");
    api = await import("@nats-io/jetstream");
    nc = await transport.connect(opts);
    js = api.jetstream(nc);
    jsm = await api.jetstreamManager(nc);
  }
  (async () => {
    for await (const s of nc.status()) {
      if (s.type === "error" || String(s.type).includes("rror")) out.errors.push(String(s.error ?? s.data ?? s.type));
    }
  })();
  const stream = cfg.stream;
  const filter = gen === "v2" ? "filterSubjects" : "filter_subjects";

  // a consumer named after the observer's user, acked message by message, then deleted
  await attempt("named", async () => {
    const name = `${cfg.user}_1`;
    const ci = await jsm.consumers.add(stream, { name, ack_policy: "explicit", filter_subject: cfg.subject,
                                                 inactive_threshold: 30_000_000_000 });
    const c = await js.consumers.get(stream, ci.name);
    const got = [];
    const msgs = await c.consume();
    for await (const m of msgs) {
      got.push(m.subject);
      m.ack();
      if (got.length >= want) break;
    }
    await msgs.stop();
    await nc.flush();
    const after = await jsm.consumers.info(stream, ci.name);
    await jsm.consumers.delete(stream, ci.name);
    return { subjects: got, ack_pending: after.num_ack_pending, named: ci.name };
  });
  out.replay_errors = [...out.errors]; // none expected: the replay above is permitted

  // the ordered pull consumer (`js.consumers.get(stream, {filter})`) names itself (a random prefix):
  // refused, as is every name not the observer's own
  await attempt("ordered_pull", async () => {
    const c = await js.consumers.get(stream, { [filter]: cfg.subject });
    const msgs = await c.consume();
    return await take(msgs, want, () => msgs.stop());
  });
  // another observer's consumer: no info, no pull, no delete
  for (const [what, fn] of [
    ["info", () => jsm.consumers.info(stream, cfg.otherConsumer)],
    ["pull", async () => {
      const it = await (await js.consumers.get(stream, cfg.otherConsumer)).fetch({ max_messages: 1, expires: 2000 });
      const got = [];
      for await (const m of it) got.push(m.subject);
      return got;
    }],
    ["delete", () => jsm.consumers.delete(stream, cfg.otherConsumer)],
  ]) {
    try {
      out.other = { ...out.other, [what]: await within(5000, fn(), what) };
    } catch (err) {
      out.other = { ...out.other, [`${what}_error`]: String(err && err.message || err) };
    }
  }

  // a worker's consumer stays out of reach: a pull from it gets nothing ...
  try {
    const w = await js.consumers.get(cfg.workerStream, cfg.workerConsumer);
    const it = await w.fetch({ max_messages: 1, expires: 2000 });
    const got = [];
    for await (const m of it) got.push(m.subject);
    out.worker.pulled = got;
  } catch (err) {
    out.worker.pull_error = String(err && err.message || err);
  }
  // ... and the unnamed create naming it in the body (it would narrow its filter) is refused
  try {
    await within(5000, jsm.consumers.add(cfg.workerStream, {
      name: cfg.workerConsumer, ack_policy: "explicit", filter_subjects: ["aios.block.none.create"],
      inactive_threshold: 1_000_000_000 }), "update");
    out.worker.updated = true;
  } catch (err) {
    out.worker.update_error = String(err && err.message || err);
  }
  await nc.flush();
  await new Promise((r) => setTimeout(r, 200)); // the server's -ERR for the last publish
  console.log(JSON.stringify(out));
  await nc.close();
}

main().then(() => process.exit(0), (err) => {
  console.log(JSON.stringify({ ...out, fatal: String(err && err.stack || err) }));
  process.exit(1);
});
