import os

print(os.environ.get("GREETING", "hi") + " world")
