// The JS PullWorker's side of tests/acceptance/test_pull_permits.py (Node).
// Usage: node js_permits.mjs <sdk index.js> <base URL> <key> <worker class> <case> <provider> [n]
// Claims one request and runs the case's body on it; prints one JSON line per event.
//   rpm:    takes n permits one after another, settling each; the result lists their grant
//           times (Redis clock)
//   budget: asks for a permit of n tokens (100 by default) a budget refuses; prints what the
//           body caught, then rethrows
//   hold:   takes a permit, prints its grant time, and never settles (the test kills it)

const [sdkPath, baseUrl, apiKey, workerClass, kase, provider, n] = process.argv.slice(2);
const { PullWorker, BudgetExceeded } = await import(sdkPath);

const say = (what) => console.log(JSON.stringify(what));

const bodies = {
  rpm: async (ctx) => {
    const granted = [];
    for (let i = 0; i < Number(n); i++) {
      const at = await ctx.permit(provider, { tokens: 1, cellKey: `js:${i}` }, async (permit) => {
        await permit.settle({ inputTokens: 1, outputTokens: 0 }, { model: "js-model" });
        return permit.grantedAtMs;
      });
      granted.push(at);
    }
    return { granted };
  },
  budget: async (ctx) => {
    try {
      await ctx.permit(provider, { tokens: Number(n ?? 100) }, async () => "never called");
    } catch (error) {
      say({ caught: error?.name, budget: error instanceof BudgetExceeded, onExceeded: error?.onExceeded, period: error?.period });
      throw error;
    }
    return { unexpected: true };
  },
  hold: async (ctx) => {
    const permit = await ctx.permit(provider, { tokens: 1 });
    say({ granted: permit.grantedAtMs, expiresInMs: permit.expiresInMs });
    await new Promise(() => {}); // a tab that hangs until it is closed
  },
};

const worker = new PullWorker({ baseUrl, apiKey, workerClass, leader: false, leaseSeconds: 30, waitSeconds: 5 });
const deadline = Date.now() + 60_000;
let outcome = null;
while (outcome === null && Date.now() < deadline) outcome = await worker.runOnce(bodies[kase], { wait: 5 });
say({ outcome });
