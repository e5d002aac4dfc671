// onceflow's browser SDK: `import { WorkspaceClient, PullWorker } from "/sdk/index.js"`.
// Served by `onceflow api` under /sdk/, publishable from this folder as an npm package.
export * from "./transport.js";
export * from "./workspace-client.js";
export * from "./pull-worker.js";
