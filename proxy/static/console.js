// tool-proxy console: confirmations before changes, and live regions over SSE.
// Everything works without it; the Content-Security-Policy allows no inline script.
"use strict";

document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.dataset.confirm;
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});

function follow(region) {
  const source = new EventSource(region.dataset.live);
  source.addEventListener("live", (event) => {
    // keep what the operator selected in the region (operations' checkboxes)
    const checked = new Set(
      Array.from(region.querySelectorAll("input[type=checkbox]:checked"), (box) => box.value));
    region.innerHTML = event.data;
    for (const box of region.querySelectorAll("input[type=checkbox]")) {
      box.checked = checked.has(box.value);
    }
    region.classList.remove("updated");
    void region.offsetWidth;
    region.classList.add("updated");
    region.dataset.updates = String(Number(region.dataset.updates || "0") + 1);
  });
}

for (const region of document.querySelectorAll("[data-live]")) {
  follow(region);
}
