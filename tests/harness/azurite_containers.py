"""Creates blob containers in Azurite (object_store cannot create them).

Usage: azurite_containers.py CONNECTION_STRING CONTAINER...
Existing containers are left as they are, so this is safe to run again.
"""

import sys
import time

from azure.core.exceptions import ResourceExistsError, ServiceRequestError
from azure.storage.blob import BlobServiceClient


def main() -> int:
    conn, containers = sys.argv[1], sys.argv[2:]
    service = BlobServiceClient.from_connection_string(conn)
    for name in containers:
        deadline = time.monotonic() + 20
        while True:
            try:
                service.create_container(name)
                print(f"created container {name}")
                break
            except ResourceExistsError:
                print(f"container {name} exists")
                break
            except ServiceRequestError as e:  # Azurite still starting
                if time.monotonic() > deadline:
                    print(f"cannot reach Azurite to create {name}: {e}", file=sys.stderr)
                    return 1
                time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
