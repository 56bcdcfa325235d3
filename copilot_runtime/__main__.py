from copilot_runtime.cli import main

main()
