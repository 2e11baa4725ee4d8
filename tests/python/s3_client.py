"""Small S3 client for the object store tests (boto3 against the local moto server).

usage: s3_client.py ENDPOINT BUCKET mkbucket
       s3_client.py ENDPOINT BUCKET put DIR PREFIX     upload every file of DIR under PREFIX/
       s3_client.py ENDPOINT BUCKET get PREFIX DIR     download every object under PREFIX/ into DIR
       s3_client.py ENDPOINT BUCKET ls PREFIX          print object names under PREFIX/, one a line
       s3_client.py ENDPOINT BUCKET rm KEY             delete the object KEY
"""

import os
import sys

import boto3


def main():
    endpoint, bucket, cmd, *args = sys.argv[1:]
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    if cmd == "mkbucket":
        s3.create_bucket(Bucket=bucket)
    elif cmd == "put":
        d, prefix = args
        for f in sorted(os.listdir(d)):
            s3.upload_file(os.path.join(d, f), bucket, f"{prefix}/{f}")
    elif cmd == "get":
        prefix, d = args
        os.makedirs(d, exist_ok=True)
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for o in (o for p in pages for o in p.get("Contents", [])):
            dst = os.path.join(d, o["Key"][len(prefix) + 1 :])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            s3.download_file(bucket, o["Key"], dst)
    elif cmd == "ls":
        (prefix,) = args
        for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
            print(o["Key"][len(prefix) + 1 :])
        # Unfinished multipart uploads would be partial output too.
        for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", []):
            print("UPLOAD-IN-PROGRESS", u["Key"])
    elif cmd == "rm":
        (key,) = args
        s3.delete_object(Bucket=bucket, Key=key)
    elif cmd == "rm-suffix":
        prefix, suffix = args
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for o in (o for p in pages for o in p.get("Contents", [])):
            if o["Key"].endswith(suffix):
                s3.delete_object(Bucket=bucket, Key=o["Key"])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
