// Requeue and cancel: POST /dashboard/api/requests/{id}/{action}, fenced on what the
// operator saw (a running row's run for cancel, the row's version otherwise) and naming the
// row's workspace (a request is found by its key, not by its id alone). Changed since: 409.

import { $, authHeaders, errorText } from "./util.js";

/** A button that runs ``action`` on ``item`` ({request_id, workspace_id, run|version}). */
export function actionButton(label, action, item, after) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = action;
  b.addEventListener("click", () => act(action, item, b, after));
  return b;
}

export async function act(action, item, button, after) {
  const out = $("#action-result");
  out.dataset.outcome = "pending";
  button.disabled = true;
  let text;
  let ok = false;
  try {
    const fence = item.run && action === "cancel" ? { run: item.run } : { version: item.version };
    const response = await fetch(
      `/dashboard/api/requests/${encodeURIComponent(item.request_id)}/${action}`,
      {
        method: "POST",
        headers: { ...authHeaders(), "Content-Type": "application/json" },
        body: JSON.stringify({ ...fence, workspace_id: item.workspace_id }),
      },
    );
    if (response.ok) {
      const body = await response.json();
      ok = true;
      text = `${action} ${item.request_id}: done (now ${body.status}).`;
    } else {
      text = `Refused (${response.status}): ${await errorText(response)}`;
    }
  } catch (err) {
    text = `${action} ${item.request_id} failed: ${err.message}`;
  }
  out.textContent = text;
  out.className = ok ? "ok" : "bad";
  out.dataset.outcome = ok ? "ok" : "refused";
  out.hidden = false;
  button.disabled = false;
  if (after) after(ok);
}
