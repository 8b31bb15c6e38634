"""The phonebook agent as a program of its own, the way an agent in another language or framework
trains: rollwise runs it once per episode (`env = "agent"`, `env_options = { command = ["python",
"examples/phonebook_agent_cli.py"] }`) with OPENAI_BASE_URL and OPENAI_API_KEY pointing at the
episode's gateway, writes the task as one line of JSON to its stdin and reads the reward from the
last line it prints. Nothing here knows about rollwise: the same program runs against any
OpenAI-compatible server with those two variables set.

    echo '{"name": "Ana Berg", "field": "room", "answer": 7, "directory": {"Ana Berg": {"room": 7}}}' \\
        | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=- python examples/phonebook_agent_cli.py

With `--serve` it stays up and runs every episode it is sent, concurrently (`env_options = {
command = ["python", "examples/phonebook_agent_cli.py", "--serve"], serve = true }`): one JSON line
per episode on stdin ({"id", "task", "base_url", "api_key"}, or {"id", "cancel": true}), one line
{"id", "reward"} or {"id", "error"} on stdout as each ends (rollwise.agent.agent_server).
"""
import asyncio
import json
import sys

import openai

from phonebook_agent import PhonebookAgent  # (this file's directory is on the path when it runs)


async def serve() -> None:
    agent, running = PhonebookAgent(), {}
    http = openai.DefaultAsyncHttpxClient()  # one pool for every episode (a client of its own: ~16 ms to make)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def episode(msg: dict) -> None:
        try:
            client = openai.AsyncOpenAI(base_url=msg["base_url"], api_key=msg["api_key"], max_retries=0,
                                        http_client=http)
            answer = {"id": msg["id"], "reward": await agent.run(client, msg["task"])}
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - this episode's failure, reported; the server goes on
            answer = {"id": msg["id"], "error": f"{type(e).__name__}: {e}"}
        finally:
            running.pop(msg["id"], None)
        print(json.dumps(answer), flush=True)

    async for line in reader:
        msg = json.loads(line)
        if msg.get("cancel"):
            if msg["id"] in running:
                running[msg["id"]].cancel()
        else:
            running[msg["id"]] = asyncio.create_task(episode(msg))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        asyncio.run(serve())
    else:
        task = json.loads(sys.stdin.readline())
        client = openai.AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
        print(asyncio.run(PhonebookAgent().run(client, task)))
