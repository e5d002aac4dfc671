export * from "./transport.js";
export * from "./workspace-client.js";
export * from "./pull-worker.js";
