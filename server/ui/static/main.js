// The page: the header (model, API key), the playground and the engine view.

import { apiKey, getJSON, setApiKey } from "./api.js";
import { $, el } from "./dom.js";
import { EngineView } from "./engine_view.js";
import { Playground } from "./playground.js";

async function loadModels() {
  const select = $("#model");
  const status = $("#status");
  try {
    const models = await getJSON("/v1/models");
    select.replaceChildren(...models.data.map((m) => el("option", { value: m.id, text: m.id })));
    status.textContent = "";
    status.dataset.kind = "ok";
  } catch (error) {
    status.textContent = error.status === 401 ? "type the server's API key" : error.message;
    status.dataset.kind = "error";
  }
}

const view = new EngineView();
new Playground({ model: () => $("#model").value, onRequest: (id) => view.markMine(id) });

const key = $("#api-key");
key.value = apiKey();
key.addEventListener("change", () => {
  setApiKey(key.value.trim());
  loadModels();
  view.restart();
});

loadModels();
view.start();
