// The lifecycle contract's bodies under the JS PullWorker (Node): the same cases as
// tests/contract/bodies.py. Usage: node js_worker.mjs <sdk index.js> <base URL> <key>
// <worker class> <case> <runs>: claims and runs the case's request `runs` times, then
// prints the outcomes as JSON.

const [sdkPath, baseUrl, apiKey, workerClass, kase, runs] = process.argv.slice(2);
const { PullWorker, PermanentError, RetryLater } = await import(sdkPath);

class ValueError extends Error {
  constructor(message) {
    super(message);
    this.name = "ValueError";
  }
}
class RuntimeError extends Error {
  constructor(message) {
    super(message);
    this.name = "RuntimeError";
  }
}

const PAYLOAD_LIMIT = 100_000;
const bodies = {
  succeed: () => ({ ok: true }),
  retry_later: () => { throw new RetryLater(120, "rate limited"); },
  retry_later_long: () => { throw new RetryLater(100_000, "come back tomorrow"); },
  permanent: () => { throw new PermanentError("bad data"); },
  retry_on_hit: (ctx) => {
    if (ctx.attempt === 1) throw new ValueError("first attempt");
    return { attempt: ctx.attempt };
  },
  retry_on_miss: () => { throw new ValueError("not in retry_on"); },
  exhausted: (ctx) => { throw new RuntimeError(`boom on attempt ${ctx.attempt}`); },
  refused_result: () => ({ blob: "x".repeat(2 * PAYLOAD_LIMIT) }),
  budget_wait: (ctx) => ctx.permit("k-budgeted", {}, async () => { throw new Error("a refused permit runs no body"); }),
  budget_fail: (ctx) => ctx.permit("k-budgeted", {}, async () => { throw new Error("a refused permit runs no body"); }),
  // Works until told to stop: ctx.signal aborts once the lease ended at the run deadline.
  overruns: (ctx) => new Promise((_, reject) => {
    ctx.signal.addEventListener("abort", () => reject(ctx.signal.reason), { once: true });
  }),
};
const retryOn = {
  retry_on_hit: (e) => e instanceof ValueError,
  retry_on_miss: (e) => e?.name === "KeyError",
};

const worker = new PullWorker({
  baseUrl, apiKey, workerClass, leader: false, leaseSeconds: 10, waitSeconds: 5, retryOn: retryOn[kase],
});
const outcomes = [];
const deadline = Date.now() + 60_000;
while (outcomes.length < Number(runs) && Date.now() < deadline) {
  const outcome = await worker.runOnce(bodies[kase], { wait: 5 });
  if (outcome !== null) outcomes.push(outcome);
}
console.log(JSON.stringify(outcomes));
