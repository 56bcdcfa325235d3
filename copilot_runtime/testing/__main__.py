from copilot_runtime.testing.mock_openai import main

main(prog="python -m copilot_runtime.testing")
