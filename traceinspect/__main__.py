from traceinspect.cli import run

run()
