from copilot_runtime.testing.mock_openai import main

main()
