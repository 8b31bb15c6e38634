"""The phonebook agent as a program of its own, the way an agent in another language or framework
trains: rollwise runs it once per episode (`env = "agent"`, `env_options = { command = ["python",
"examples/phonebook_agent_cli.py"] }`) with OPENAI_BASE_URL and OPENAI_API_KEY pointing at the
episode's gateway, writes the task as one line of JSON to its stdin and reads the reward from the
last line it prints. Nothing here knows about rollwise: the same program runs against any
OpenAI-compatible server with those two variables set.

    echo '{"name": "Ana Berg", "field": "room", "answer": 7, "directory": {"Ana Berg": {"room": 7}}}' \\
        | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=- python examples/phonebook_agent_cli.py
"""
import asyncio
import json
import sys

import openai

from phonebook_agent import PhonebookAgent  # (this file's directory is on the path when it runs)

if __name__ == "__main__":
    task = json.loads(sys.stdin.readline())
    client = openai.AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
    print(asyncio.run(PhonebookAgent().run(client, task)))
