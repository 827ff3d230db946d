"""OpenAI's own Node.js SDK (the `openai` npm package) against a live gateway: a client we did not write
streams a chat completion, and its text is the answer the Python SDK gets without streaming."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import openai
import pytest

from tests.integration.gateway.conftest import Live
from tests.integration.package_index import install

# An exact version, so a new release cannot change what passes. 6.x needs no dependencies and runs on
# Node 20 (7.x asks for Node 22).
OPENAI_NPM = "openai@6.49.0"
PROMPT = "Once upon a time"

CHAT_SCRIPT = """\
import OpenAI from "openai";

const [baseURL, prompt, maxTokens] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0 });
const stream = await client.chat.completions.create({
  model: "",
  messages: [{ role: "user", content: prompt }],
  max_tokens: Number(maxTokens),
  temperature: 0,
  stream: true,
});
let text = "";
let finishReason = null;
let chunks = 0;
for await (const chunk of stream) {
  chunks += 1;
  for (const choice of chunk.choices) {
    text += choice.delta?.content ?? "";
    finishReason = choice.finish_reason ?? finishReason;
  }
}
process.stdout.write(text + "\\n" + JSON.stringify({ finish_reason: finishReason, chunks }) + "\\n");
"""


@pytest.fixture(scope="module")
def chat_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: the Node.js OpenAI SDK cannot be tested")
    directory = tmp_path_factory.mktemp("node-openai")
    # A package.json of its own keeps npm from installing into a package.json found further up.
    (directory / "package.json").write_text(json.dumps({"name": "chat", "private": True}))
    install(["npm", "install", "--no-audit", "--no-fund", OPENAI_NPM], cwd=directory)  # offline: a skip
    script = directory / "chat.mjs"
    script.write_text(CHAT_SCRIPT)
    return script


async def _run_node(script: Path, *args: str) -> tuple[int, str, str]:
    # Not subprocess.run: the gateway and the services run on this test's event loop and must keep
    # answering while node waits for them.
    process = await asyncio.create_subprocess_exec(
        "node", str(script), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, stdout.decode(), stderr.decode()


async def test_the_node_sdk_streams_the_answer_the_python_sdk_gets_whole(
    live: Live, chat_script: Path
) -> None:
    returncode, stdout, stderr = await _run_node(chat_script, live.base_url, PROMPT, "12")
    assert returncode == 0, stderr
    text, _, last_line = stdout.rstrip("\n").rpartition("\n")
    summary = json.loads(last_line)

    async with openai.AsyncOpenAI(base_url=live.base_url, api_key="none", max_retries=0) as client:
        whole = await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0
        )
    assert text == whole.choices[0].message.content
    assert summary["finish_reason"] in ("length", "stop")
    assert summary["finish_reason"] == whole.choices[0].finish_reason
    assert summary["chunks"] >= 2  # the opening role chunk, then the text: it did stream
