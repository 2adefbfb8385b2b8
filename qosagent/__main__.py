from qosagent.cli import main

main()
